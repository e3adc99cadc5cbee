"""Server configuration: plain dataclasses, filled from the command line or VOX_WS_* variables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Limits:
    """The limits a server publishes (protocol v1's `hello`) and enforces on every front door."""

    max_frame_bytes: int = 2 << 20
    max_text_chars: int = 5000
    max_streams: int = 8
    idle_timeout_s: float = 60.0
    max_queue: int = 64
    max_queue_wait_s: float = 30.0
    max_buffered_audio_s: float = 10.0
    write_stall_timeout_s: float = 20.0
    stream_timeout_s: float = 30.0
    # Input streaming: text with no sentence or clause end yet is spoken anyway once the input
    # has paused this long (whole words only), so a reply without punctuation starts promptly.
    input_pause_s: float = 0.4
    max_voice_audio_s: float = 30.0
    max_voices: int = 256
    max_voices_per_owner: int = 32
    # A client without a token (known by its address) keeps this many voices, each for
    # `voice_ttl_s` (0: for ever).
    max_voices_per_address: int = 4
    voice_ttl_s: float = 86400.0
    # Voice registrations waiting or running (each holds its reference audio meanwhile).
    max_pending_voices_per_owner: int = 2
    max_pending_voices: int = 16
    max_connections: int = 256
    max_connections_per_address: int = 32
    max_messages_per_s: float = 50.0
    # An HTTP request's body: seconds it has, one more for every `body_min_rate` bytes received,
    # `body_max_s` at the most (a body that trickles in holds a connection and its buffers).
    body_timeout_s: float = 20.0
    body_min_rate: float = 1000.0
    body_max_s: float = 120.0
    # Bytes a second per address of request bodies answered before they were read (refused)
    # that the server still reads, to drop them and keep the connection; in bursts of four
    # `max_frame_bytes` bodies. Beyond, such a connection is closed.
    discard_bytes_per_s: float = float(1 << 20)
    # HTTP requests a second per address the server answers 429 (too many, busy) before it stops
    # hearing that address: its new connections are closed at accept, before any HTTP is read,
    # until the budget (bursts of five seconds' worth) has refilled. 0: always heard.
    refused_requests_per_s: float = 20.0
    # Bytes whole responses (`stream: false`) hold until sent, per owner and in all (past 2 MB
    # each, in a temporary file).
    max_whole_bytes_per_owner: int = 128 << 20
    max_whole_bytes: int = 1 << 30
    # Bytes a second a whole response must be taken at, on average, once sending starts: it has
    # `write_stall_timeout_s`, one second more for every `whole_min_rate` bytes its client takes,
    # never more than `write_stall_timeout_s` ahead (a reader slower than that holds its bytes
    # and everyone's budget: it is closed). 16 KiB/s: a 128 kbit/s link. 0: no floor.
    whole_min_rate: float = float(16 << 10)
    # An unloading LoRA adapter's streams have this long to finish; then they end (`bad_request`)
    # and its slot frees, so a stream that keeps sending a word now and then cannot hold it.
    lora_unload_timeout_s: float = 30.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    engine: str = "auto"
    device: str = "auto"
    threads: int = 1
    # Slots per device (streams generated at once); None: sized to the device once the engine
    # has loaded (`Engine.slots`; the command line's default, `--slots auto`).
    slots: int | None = 8
    # Slots one client (a connection; a token or address) may hold while others wait;
    # None: half of slots.
    max_share: int | None = None
    # The chosen engine's own settings (by key, e.g. "lora_rank"); see vox_ws.engines.
    engine_settings: dict[str, Any] = field(default_factory=dict)
    drain_timeout: float = 10.0
    ping_interval: float = 10.0
    ping_timeout: float = 20.0
    admin_tokens: list[str] = field(default_factory=list)
    # Client tokens: when any is set, every connection must present one (or an admin token).
    tokens: list[str] = field(default_factory=list)
    # Browser origins allowed to connect; empty allows any. Clients that send no Origin
    # header (servers, not browsers) are not affected.
    allow_origins: list[str] = field(default_factory=list)
    # Origins whose pages may call the HTTP API from a browser (CORS); "*" any (no credentials
    # are ever allowed: tokens go in the Authorization header). Empty: none. Within
    # `allow_origins` where that is set.
    cors_origins: list[str] = field(default_factory=list)
    # Host names the server answers to besides those no outside attacker can re-point at it (IP
    # literals, localhost, single-label and special-use names, the machine's own name): a request
    # for another is refused 421 (DNS rebinding, transports/hosts.py). ".example.com": it and its
    # subdomains; "*": any (no check).
    allowed_hosts: list[str] = field(default_factory=list)
    # A JSON or TOML file of voice aliases (service/voices/aliases.py); None: the defaults.
    voice_aliases: str | None = None
    # With client tokens set: whether /v1/info and /metrics need one too (they say how busy the
    # server is and which voices it has). /healthz and /readyz stay open for probes.
    private_info: bool = False
    # What /metrics' per-owner labels are keyed by (an HMAC): replicas given the same label an
    # owner alike, and `vox-ws owner` finds an owner's label with it. None: random at each start.
    metrics_secret: str | None = None
    # Balancers whose connections say who the client is (PROXY protocol, or `proxy_header`):
    # addresses or networks (CIDR). From anyone else, those are ignored (transports/proxies.py).
    trusted_proxies: list[str] = field(default_factory=list)
    # The header a trusted proxy writes the client in: x-forwarded-for, forwarded or none.
    proxy_header: str = "x-forwarded-for"
    # Model names the OpenAI door takes for the served model, beside its own, OpenAI's and `kokoro`.
    model_aliases: list[str] = field(default_factory=list)
    # An IPv6 client counts by this many leading bits of its address (`vox_ws.addresses`).
    ipv6_prefix: int = 64
    # The browser demo served at `/` (default: web/demo of the source tree when present).
    demo_dir: str | None = None
    # Readiness turns 503, and new connections are closed 1013, while every slot is busy (for
    # balancers that should send new sessions elsewhere).
    unready_when_full: bool = False
    # Where registered voices are kept: memory, dir:PATH or redis://HOST:PORT/DB (see
    # service/voices/store.py); the command line's default is a directory.
    voice_store: str = "memory"
    voice_store_max_mb: float = 512.0
    # Also serve the Wyoming protocol (Home Assistant) here: tcp://HOST:PORT or unix://PATH.
    wyoming: str | None = None
    # Advertise the Wyoming door on the local network (zeroconf) under this name.
    zeroconf: str | None = None
    # The server's pronunciations (a JSON or TSV file, vox_ws/engines/lexicon.py); reloaded on SIGHUP
    # and by `POST /v1/lexicon` with an admin token.
    lexicon: str | None = None
    # Where word times come from: auto (the engine's own, else the aligner's), aligned (the
    # aligner's for every engine) or engine (never the aligner). See service/word_timings.py.
    word_timings: str = "auto"
    # The aligner's processes at most (alignment/pool.py), never more than the CPUs of the cgroup's
    # quota; each starts when a segment finds the others busy, and holds some 125 MB. One aligns a
    # sentence of 2.8 s of speech in 0.06 s (RTF 0.022, docs/PERFORMANCE.md): 16 segments a second,
    # three times what Piper speaks on a whole 2-core host (14.6 s of audio, 5 sentences, a
    # second); two held 122 real-time streams. One per CPU, as before, was 12 GB on a 96-CPU node.
    aligners: int = 2
    # Engine processes started on each device (`--engines-per-device`: several share one GPU
    # under CUDA MPS); their CPUs, one list per engine process ("0-3;4-7"), the server taking the
    # rest (None: chosen where several engine processes share the machine: `placement.py`).
    engines_per_device: int = 1
    engine_cpus: str | None = None
    # An engine process that dies is started again, after a back-off, unless it died this many
    # times within `engine_restart_window` seconds: the server then stops (exit code 3).
    engine_restarts: int = 5
    engine_restart_window: float = 600.0
    limits: Limits = field(default_factory=Limits)

    def engine_options(self) -> dict[str, Any]:
        """What the engine registry's `create` receives: the common settings and the engine's own."""
        return {"device": self.device, "threads": self.threads, "slots": self.slots, **self.engine_settings}
