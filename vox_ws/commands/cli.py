"""`vox-ws` command line. Every `serve` option can also be set as VOX_WS_<OPTION> in the environment."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import sys
from typing import Any, Callable, Sequence

from .. import __version__, engines
from ..config import Limits, ServerConfig
from ..transports.proxies import FORWARDING_HEADERS
from . import logs


def _ipv6_prefix(text: str) -> int:
    from ..addresses import check_ipv6_prefix

    try:
        return check_ipv6_prefix(int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1")
    return value


def _proxy_header(text: str) -> str:
    if text.lower() not in FORWARDING_HEADERS:
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(FORWARDING_HEADERS)}")
    return text.lower()


# (option, type, default, help); the destination is the option name with '-' -> '_'. The engines'
# own settings come from the engine registry (see `_engine_options`).
_SERVE_OPTIONS: list[tuple[str, Callable[[str], Any], Any, str]] = [
    ("host", str, "127.0.0.1", "address to listen on"),
    ("port", int, 8765, "port for WebSocket and HTTP (0: any free port)"),
    ("engine", str, "auto", "engine to serve (see the list below); auto picks VoxCPM2 with a GPU and weights, "
                            "else Piper"),
    ("token", str, None, "client tokens (comma-separated); when set, connections must present one"),
    ("admin-token", str, None, "token for admin operations (LoRA, the lexicon's reload, every owner's "
                               "voices, Piper voices fetched by name); comma-separated for several"),
    ("allow-origin", str, None, "browser origins allowed to connect (comma-separated); default any"),
    ("cors-origins", str, None, "origins whose pages may call the HTTP API (CORS; comma-separated, or *); "
                                "default none"),
    ("allowed-hosts", str, None, "host names the server answers to (comma-separated; .example.com: it and "
                                 "its subdomains; *: any), besides IP literals, localhost, single-label and "
                                 ".local/.internal names and the machine's own name; a request for another "
                                 "is refused 421 (DNS rebinding)"),
    ("voice-aliases", str, None, "a JSON or TOML file of voice aliases (e.g. alloy = \"joe\"; echo = false takes "
                                 "a default away), added to the defaults: OpenAI's names on distinct voices where "
                                 "the engine has them (docs/PROTOCOL.md)"),
    ("private-info", engines.parse_bool, False, "with --token: /v1/info, /metrics and the voice and model lists "
                                                "need a token too"),
    ("metrics-secret", str, None, "the key of /metrics' per-owner labels (an HMAC of the token or address); give "
                                  "replicas the same one, and `vox-ws owner` finds a label with it (default: random "
                                  "at each start)"),
    ("trusted-proxies", str, None, "balancers (addresses or CIDR networks, comma-separated) whose connections say "
                                   "who the client is: a PROXY protocol header (v1/v2), else --proxy-header; from "
                                   "others both are ignored (docs/DEPLOY.md). Default: none"),
    ("proxy-header", _proxy_header, "x-forwarded-for",
     "the header a trusted proxy names the client in: x-forwarded-for, "
     "forwarded (RFC 7239) or none (PROXY protocol only)"),
    ("model-aliases", str, None, "more model names (comma-separated) the OpenAI door takes for the served model "
                                 "(its own, OpenAI's and `kokoro` always are; any other is served and named in "
                                 "X-Ignored-Parameters)"),
    ("ipv6-prefix", _ipv6_prefix, 64, "leading bits of an IPv6 address that name one client, for every per-address "
                                      "bound and owner (16-128; every IPv6 host has a /64)"),
    ("max-connections", int, Limits.max_connections, "open connections in total (then close 1013)"),
    ("max-connections-per-address", int, Limits.max_connections_per_address,
     "open connections per client address (then close 4029)"),
    ("max-messages-per-second", float, Limits.max_messages_per_s, "client messages per second per connection"),
    ("slots", engines.parse_count, "auto", "KV slots per device: streams generated at once (memory; --step-rows is "
                                  "compute); auto sizes them to the device (GPU memory, CPU step time; see "
                                  "docs/DEPLOY.md). Also spelt --max-batch"),
    ("max-queue", int, Limits.max_queue, "streams that may wait for a slot; beyond it, `busy`"),
    ("max-queue-wait", float, Limits.max_queue_wait_s, "seconds a stream may wait for a slot; then `busy`"),
    ("max-share", int, None, "slots one client (connection, token or address) may hold while others wait "
                             "(default: half of --slots)"),
    ("max-streams", int, Limits.max_streams, "open streams per connection"),
    ("max-text-chars", int, Limits.max_text_chars, "characters per text"),
    ("max-frame-bytes", int, Limits.max_frame_bytes, "bytes per client frame (and per HTTP upload)"),
    ("max-voice-seconds", float, Limits.max_voice_audio_s, "seconds of reference audio per voice"),
    ("max-voices", int, Limits.max_voices, "registered voices the server keeps in all"),
    ("max-voices-per-owner", int, Limits.max_voices_per_owner,
     "registered voices per client token; one more retires the owner's oldest"),
    ("max-voices-per-address", int, Limits.max_voices_per_address,
     "registered voices of a client without a token (by its address); one more retires its oldest"),
    ("voice-ttl", float, Limits.voice_ttl_s, "seconds a voice registered without a token is kept (0: for ever)"),
    ("voice-store", str, "dir:~/.local/share/vox-ws/voices",
     "where registered voices are kept: dir:PATH (survives restarts), redis://HOST:PORT/DB (shared by "
     "replicas) or memory"),
    ("voice-store-max-mb", float, 512.0, "reference audio the voice store may hold, in MB (then `busy`)"),
    ("max-whole-mb-per-owner", float, Limits.max_whole_bytes_per_owner / 2**20,
     "MB whole responses (`stream: false`) of one client may hold until sent (then 413, or `busy` beside others)"),
    ("max-whole-mb", float, Limits.max_whole_bytes / 2**20, "MB all whole responses may hold until sent (then `busy`)"),
    ("whole-min-rate", float, Limits.whole_min_rate,
     "bytes a second a whole response's client must take it at, on average (after --write-stall-timeout, "
     "which is also the most it may bank); a slower one is closed and its bytes given back (0: no floor)"),
    ("idle-timeout", float, Limits.idle_timeout_s,
     "seconds before a connection with no stream and no message is closed"),
    ("max-buffered-audio", float, Limits.max_buffered_audio_s,
     "audio seconds a stream may have unsent before generation pauses"),
    ("write-stall-timeout", float, Limits.write_stall_timeout_s,
     "seconds a paused stream may wait on its reader before `slow_consumer`"),
    ("body-timeout", float, Limits.body_timeout_s, "seconds an HTTP request body has before --body-min-rate counts"),
    ("body-min-rate", float, Limits.body_min_rate, ("bytes a second an HTTP body must keep up after that (each "
                                                    "such many bytes earn one more second)")),
    ("body-max", float, Limits.body_max_s, "seconds an HTTP request body may take at the most"),
    ("discard-rate", float, Limits.discard_bytes_per_s, ("bytes a second per address of refused HTTP bodies "
                                                          "read to keep their connections (then closed)")),
    ("refused-rate", float, Limits.refused_requests_per_s, ("refused requests a second per address (any HTTP 4xx, "
                                                             "any refused WebSocket handshake) before its new "
                                                             "connections are closed at accept")),
    ("lora-unload-timeout", float, Limits.lora_unload_timeout_s, "seconds the streams of an unloading LoRA adapter "
                                                                 "have to finish before they end"),
    ("input-pause", float, Limits.input_pause_s, "input streaming: seconds of quiet after which buffered words "
                                                 "without a sentence end are spoken"),
    ("unready-when-full", engines.parse_bool, False, "readiness 503 and new connections closed 1013 while every "
                                                     "slot is busy (behind a balancer)"),
    ("drain-timeout", float, 10.0, "seconds streams may finish after SIGTERM"),
    ("lexicon", str, None, "the server's pronunciations: a JSON or TSV file (see docs/PROTOCOL.md); reloaded on "
                           "SIGHUP and by POST /v1/lexicon with an admin token"),
    ("word-timings", str, "auto", "where word times come from: auto (the engine's own, else the aligner's: "
                                  "PocketSphinx, English), aligned (the aligner's for every engine, to measure it) "
                                  "or engine (never the aligner)"),
    ("aligners", _positive, ServerConfig.aligners, "aligner processes (word times for engines without "
                                                  "their own) at most, each ~125 MB, started as segments need "
                                                  "them; never more than the CPUs of the container's quota"),
    ("engines-per-device", _positive, 1, "engine processes on each device (several share one GPU under CUDA "
                                        "MPS, started before the server: docs/DEPLOY.md)"),
    ("engine-cpus", str, None, "the CPUs of each engine process, one list per process, e.g. 0-3;4-7 (the server "
                               "takes the rest); default: where several engine processes share the machine, each "
                               "gets cores of its own, the server the rest"),
    ("engine-restarts", _positive, 5, "an engine process that dies is started again, unless it died this many "
                                      "times within --engine-restart-window seconds: the server then stops, exit 3"),
    ("engine-restart-window", float, 600.0, "seconds over which an engine process's deaths are counted"),
    ("demo-dir", str, None, "directory of the browser demo served at / (default: web/demo of the source tree)"),
    ("zeroconf", str, None, "advertise the Wyoming door on the local network (zeroconf, _wyoming._tcp) under this "
                            "name, e.g. --zeroconf vox-ws, so Home Assistant finds it by itself (needs --wyoming tcp://...)"),
    ("wyoming", str, None, "also serve the Wyoming protocol (Home Assistant) at this URI, e.g. "
                           "tcp://0.0.0.0:10200; it has no authentication: trusted networks only"),
    ("ping-interval", float, 10.0, "seconds between keepalive pings"),
    ("log-level", str, "info", "debug, info, warning or error"),
    ("log-format", str, "text", "text, or json: one JSON object a line (for log shippers)"),
]


def _engine_options() -> list[tuple[str, list[engines.Setting]]]:
    """(group title, settings): the settings every engine takes, then each engine's own. Another
    package's engine with a setting named as an option already is (the server's, or another
    engine's) is withdrawn, and listed with why: one option cannot mean two things."""
    groups = [("engine settings", list(engines.COMMON_SETTINGS))]
    taken = {option for option, *_ in _SERVE_OPTIONS} | {old for old, _ in _OLD_SPELLINGS.values()} | \
        {setting.name for setting in engines.COMMON_SETTINGS}
    for plugin in engines.plugins().values():
        clash = [setting.name for setting in plugin.settings if setting.name in taken]
        if clash:
            engines.withdraw(plugin.name, f"its setting --{clash[0]} is already an option of vox-ws serve")
            continue
        taken |= {setting.name for setting in plugin.settings}
        if plugin.settings:
            groups.append((f"{plugin.name} engine: {plugin.summary}", list(plugin.settings)))
    return groups


def _engines_epilog() -> str:
    """The engines `--engine` takes (built-in and other packages'), then those found that cannot
    be served, each with why."""
    lines = ["engines: " + ", ".join(["auto", *sorted(engines.plugins())])]
    for found in engines.installed():
        if found.available:
            source = "" if found.source == "built-in" else f" (from {found.source})"
            lines.append(f"  {found.name}{source}: {found.summary}")
    refused = [found for found in engines.installed() if not found.available]
    if refused:
        lines.append("engines installed that cannot be served:")
        lines += [f"  {found.name} (from {found.source}): {found.error}" for found in refused]
    return "\n".join(lines)


def _log_engines_not_served() -> None:
    """Another package's engine that cannot be served, said once at the server's start."""
    for found in engines.installed():
        if not found.available and found.source != "built-in":
            logging.getLogger("vox_ws.engines").warning("engine %r (from %s) cannot be served: %s",
                                                         found.name, found.source, found.error)


# Options renamed for what they are, by their old spelling (still taken, with its variable) and
# the name of the setting they fill.
_OLD_SPELLINGS = {"slots": ("max-batch", "slots")}


def _env_name(option: str) -> str:
    return "VOX_WS_" + option.upper().replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vox-ws", description="Streaming text-to-speech over WebSocket.")
    parser.add_argument("--version", action="version", version=f"vox-ws {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the server",
                                description="Run the server. Each option may also come from VOX_WS_<OPTION>.")
    engine_groups = _engine_options()
    serve.epilog = _engines_epilog()
    serve.formatter_class = argparse.RawDescriptionHelpFormatter

    def add(group: Any, option: str, kind: Callable[[str], Any], default: Any, text: str, many: bool = False) -> None:
        env = _env_name(option)
        old, dest = _OLD_SPELLINGS.get(option, (None, option.replace("-", "_")))
        raw = os.environ.get(env, os.environ.get(_env_name(old)) if old else None)
        value = default
        if raw is not None:
            try:
                value = [kind(item) for item in _list(raw)] if many else kind(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{env}={raw!r}: {exc}")
        if many:
            group.add_argument(f"--{option}", type=kind, action="append", default=None,
                               help=f"{text} [env {env}]")
            group.set_defaults(**{option.replace("-", "_"): value})
            return
        names = [f"--{option}"] + ([f"--{old}"] if old else [])
        group.add_argument(*names, dest=dest, type=kind, default=value, help=f"{text} [env {env}; default {default}]")

    from ..clients import loadtest
    from . import compile_ahead, models

    compile_command = commands.add_parser("compile", help="compile the step into the compile cache ahead of time, "
                                                          "then exit (serve's options)",
                                          description=compile_ahead.__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    for command in (serve, compile_command):
        for option, kind, default, text in _SERVE_OPTIONS:
            add(command, option, kind, default, text)
        for title, settings in engine_groups:
            group = command.add_argument_group(title)
            for setting in settings:
                add(group, setting.name, setting.kind, setting.default, setting.help, setting.many)

    say = commands.add_parser("say", help="speak a text, a file or standard input through a running server into "
                                          "one file (WAV or a codec's) or the speakers")
    say.add_argument("text", nargs="?", help="what to say (or --file)")
    say.add_argument("-f", "--file", help="a text file of any length to speak, or - for standard input")
    say.add_argument("-o", "--output", help="file to write, in the format its extension names (.wav, .mp3, .opus or "
                                            ".ogg, .aac, .flac, .pcm or .raw: s16, .ulaw: mulaw; WAV without "
                                            "one); any other extension is refused unless --format names one")
    say.add_argument("--captions", help="also write captions, .srt or .vtt (word timings where the engine has them)")
    say.add_argument("--language", help="the text's language (en, de, zh, ...): where its sentences end")
    say.add_argument("-q", "--quiet", action="store_true", help="no progress bar (none when not on a terminal)")
    say.add_argument("--format", choices=("wav", "opus", "mp3", "aac", "flac", "s16", "mulaw"),
                     help="the file's format (encoded by the server as it speaks); default: the output's extension's")
    say.add_argument("--speed", type=float, default=1.0, help="0.25-4.0, pitch kept")
    say.add_argument("--instructions", help="how to speak, in words (VoxCPM2)")
    say.add_argument("--play", action="store_true", help="play it as it arrives (needs an audio device)")
    say.add_argument("--url", default=os.environ.get("VOX_WS_URL", "ws://127.0.0.1:8765/v1/stream"))
    say.add_argument("--token", default=os.environ.get("VOX_WS_TOKEN"))
    say.add_argument("--voice")
    say.add_argument("--sample-rate", type=int)
    say.add_argument("--timeout", type=float, default=60.0,
                     help="seconds the server may say nothing while say waits on it (its hello, its answer, "
                          "the next audio) before say gives up, exit 1 (default 60: twice the server's own "
                          "30 s bounds on a queued or an idle stream)")

    owner = commands.add_parser("owner", help="the label /metrics counts a token's or an address's usage under")
    who = owner.add_mutually_exclusive_group(required=True)
    who.add_argument("--token", help="a client token (as given to --token)")
    who.add_argument("--address", help="a client address (clients without a token)")
    owner.add_argument("--metrics-secret", default=os.environ.get("VOX_WS_METRICS_SECRET"),
                       help="the server's --metrics-secret [env VOX_WS_METRICS_SECRET]")
    owner.add_argument("--ipv6-prefix", type=_ipv6_prefix, default=os.environ.get("VOX_WS_IPV6_PREFIX", "64"),
                       help="the server's --ipv6-prefix (an IPv6 address counts by its network) "
                            "[env VOX_WS_IPV6_PREFIX]")

    # The module's docstring past its first paragraph, which names source files for developers.
    about = "\n\n".join([
        "VoxCPM2 checkpoints and Piper voices on disk: `vox-ws models pull REPO` fetches a\n"
        "VoxCPM2 checkpoint, `vox-ws models pull piper:NAME` a Piper voice into the folder\n"
        "the server serves; `vox-ws models list` shows what is here and whether the engine\n"
        "can load each, `vox-ws models list --available` the Piper voices that can be pulled.",
        *(models.__doc__ or "").split("\n\n")[1:]])
    models.add_arguments(commands.add_parser("models", help="VoxCPM2 checkpoints and Piper voices: pull one, "
                                                            "list those on disk",
                                             description=about,
                                             formatter_class=argparse.RawDescriptionHelpFormatter))
    bench = commands.add_parser("bench", help="load a running server and report first audio, RTF, underruns",
                                description=loadtest.__doc__)
    loadtest.add_arguments(bench)
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    limits = Limits(
        max_frame_bytes=args.max_frame_bytes,
        max_text_chars=args.max_text_chars,
        max_streams=args.max_streams,
        idle_timeout_s=args.idle_timeout,
        max_queue=args.max_queue,
        max_queue_wait_s=args.max_queue_wait,
        max_voices=args.max_voices,
        max_voices_per_owner=args.max_voices_per_owner,
        max_voices_per_address=args.max_voices_per_address,
        voice_ttl_s=args.voice_ttl,
        max_buffered_audio_s=args.max_buffered_audio,
        write_stall_timeout_s=args.write_stall_timeout,
        max_voice_audio_s=args.max_voice_seconds,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        max_messages_per_s=args.max_messages_per_second,
        input_pause_s=args.input_pause,
        body_timeout_s=args.body_timeout,
        body_min_rate=args.body_min_rate,
        body_max_s=args.body_max,
        discard_bytes_per_s=args.discard_rate,
        refused_requests_per_s=args.refused_rate,
        lora_unload_timeout_s=args.lora_unload_timeout,
        max_whole_bytes_per_owner=int(args.max_whole_mb_per_owner * 2**20),
        max_whole_bytes=int(args.max_whole_mb * 2**20),
        whole_min_rate=args.whole_min_rate,
    )
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    values = {k: v for k, v in vars(args).items()
              if k in fields and k not in ("cors_origins", "allowed_hosts", "trusted_proxies", "model_aliases")}
    engine_keys = {s.key for _, group in _engine_options()[1:] for s in group}
    engine_settings = {k: v for k, v in vars(args).items() if k in engine_keys}
    return ServerConfig(**values, ping_timeout=max(args.ping_interval * 2, 5.0), limits=limits,
                        tokens=_list(args.token), admin_tokens=_list(args.admin_token),
                        allow_origins=_list(args.allow_origin), cors_origins=_list(args.cors_origins),
                        allowed_hosts=_list(args.allowed_hosts),
                        trusted_proxies=_list(args.trusted_proxies), model_aliases=_list(args.model_aliases),
                        engine_settings=engine_settings)


def _list(text: str | None) -> list[str]:
    return [item.strip() for item in (text or "").split(",") if item.strip()]


async def _serve(config: ServerConfig, devices: list[str], log_setup: Callable[[], None]) -> int:
    """Every start that cannot go on ends in one `vox-ws serve:` line, never a traceback: exit 2
    for options or files that cannot be served, 1 for what the machine lacks (a package, a port)."""
    from ..engine_process.devices import engine_specs
    from ..server import StartFailed, VoxServer, wyoming_door

    # One engine process (one copy of the model) per device, each with its own engine loop;
    # this process imports no model library.
    try:
        wyoming_door(config)                   # before an engine is chosen: a missing package, at once
        specs, server_cpus = engine_specs(config, devices, log_setup)
        if server_cpus:
            os.sched_setaffinity(0, server_cpus)
        server = VoxServer(config, specs)
    except ValueError as exc:                  # a setting that cannot be served (a voice file, aliases)
        print(f"vox-ws serve: {exc}", file=sys.stderr)
        return 2
    except StartFailed as exc:
        print(f"vox-ws serve: {exc}", file=sys.stderr)
        return 1
    from ..service.voices.store import StoreUnavailable

    try:
        await server.start()                   # stops what it had started before it raises
    except StoreUnavailable as exc:            # a voice store this server may not use: said in one line
        print(f"vox-ws serve: {exc.message}", file=sys.stderr)
        await asyncio.to_thread(server.devices.stop)
        return 1
    except StartFailed as exc:
        print(f"vox-ws serve: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:                  # a file read at start (the lexicon)
        print(f"vox-ws serve: {exc}", file=sys.stderr)
        return 2
    server.install_signal_handlers()
    await server.wait_stopped()
    return server.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        logs.configure(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    except ValueError as exc:
        print(f"vox-ws: {exc}", file=sys.stderr)
        return 2
    # uvicorn logs every connection at info; vox-ws logs its own sessions.
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    if args.command == "serve":
        _log_engines_not_served()
        config = config_from_args(args)
        if config.engine in engines.unavailable():
            print(f"vox-ws serve: engine {config.engine!r} is installed but cannot be served: "
                  f"{engines.unavailable()[config.engine]}", file=sys.stderr)
            return 2
        from ..engine_process.devices import parse_devices

        try:
            devices = parse_devices(config.device)
        except ValueError as exc:
            print(f"vox-ws serve: {exc}", file=sys.stderr)
            return 2
        # Each engine process logs as this one does.
        log_setup = functools.partial(logs.configure, getattr(args, "log_level", "info"),
                                      getattr(args, "log_format", "text"))
        try:
            import uvloop
        except ImportError:
            return asyncio.run(_serve(config, devices, log_setup))
        return uvloop.run(_serve(config, devices, log_setup))
    if args.command == "compile":
        from .compile_ahead import compile_ahead

        config = config_from_args(args)
        try:
            return compile_ahead(config)
        except ValueError as exc:             # a setting that cannot be served
            print(f"vox-ws compile: {exc}", file=sys.stderr)
            return 2
    if args.command == "say":
        from ..clients import say

        problem = say.check_args(args)
        if problem:
            print(f"vox-ws say: {problem}", file=sys.stderr)
            return 2
        try:
            return asyncio.run(say.say(args))
        except KeyboardInterrupt:            # said how far it got already
            return 130
    if args.command == "models":
        from . import models

        return models.main(args)
    if args.command == "bench":
        from ..clients import loadtest

        return loadtest.main(args)
    if args.command == "owner":
        from ..service.metrics import owner_label
        from ..transports.auth import address_owner, token_owner

        if not args.metrics_secret:
            print("vox-ws owner: labels are keyed by the server's --metrics-secret: give the same one", file=sys.stderr)
            return 2
        owner = token_owner(args.token) if args.token else address_owner(args.address, args.ipv6_prefix)
        print(owner_label(owner, args.metrics_secret.encode()))
        return 0
    return 2
