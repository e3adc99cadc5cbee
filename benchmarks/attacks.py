"""What an attack costs the other clients: the adversarial benchmark (issue "Hardening II").

Each attack runs alone, from a process of its own, against a fresh server (Piper; the tiny
random-weight VoxCPM2 for the attacks on voice uploads and normalisation) while one victim
client speaks a text again and again and a probe reads /healthz every 100 ms. Printed per
attack: the victim's first audio (median, against its unloaded value) and longest gap between
two chunks of a stream, its failed streams, /healthz p99, the server's peak RSS (alone, and
with its worker processes), and whether the server survived. The attacker connects from
127.0.0.2, the victim from 127.0.0.1, as if from two machines. Targets on the 2-core CI
machine: the server survives; RSS under 1 GB; /healthz p99 under 100 ms; first audio under 3x
unloaded; longest chunk gap under 1 s.

    python -m benchmarks.attacks [--attacks crash_text,ping_flood,...] [--seconds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgpack
import numpy as np

from vox_ws import wire

from . import ROOT, module_command

# The attacker connects from another loopback address than the victim, as it would from
# another machine: the server's per-address limits and fair shares tell them apart.
ATTACKER_ADDRESS = "127.0.0.2"
VICTIM_TEXT = "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks struck."
CJK_240 = ("我们今天去公园散步，天气非常好。" * 15)[:240]
LONG_TEXT = "This sentence keeps the voice busy for a while, one clause after another. " * 40


# ------------------------------------------------------------------ the attacks (run in their own process)


async def _ws(port: int, source: str = ATTACKER_ADDRESS, **kwargs: Any):
    from websockets.asyncio.client import connect

    ws = await connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None, local_addr=(source, 0), **kwargs)
    await ws.recv()
    return ws


async def _drain_forever(ws) -> None:
    try:
        async for _ in ws:
            pass
    except Exception:  # noqa: BLE001 - the attack goes on with a new connection
        pass


async def crash_text(port: int, until: float) -> None:
    """Texts that crashed espeak-ng inside Piper (item 1), one after another."""
    while time.monotonic() < until:
        ws = await _ws(port)
        for text in ("a." * 100, "b." * 100, "A.B." * 50):
            await ws.send(wire.encode(wire.Start(text=text)))
            while not isinstance(wire.read(await ws.recv()), (wire.Ended, wire.Error)):
                pass
        await ws.close()


async def ping_flood(port: int, until: float) -> None:
    """125-byte pings as fast as the socket takes them, never reading (item 2)."""
    from websockets.client import ClientProtocol
    from websockets.uri import parse_uri

    def flood() -> None:
        while time.monotonic() < until:
            sock = socket.create_connection(("127.0.0.1", port), source_address=(ATTACKER_ADDRESS, 0))
            proto = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/v1/stream"))
            proto.send_request(proto.connect())
            sock.sendall(b"".join(proto.data_to_send()))
            sock.recv(4096)
            proto.send_ping(b"p" * 125)
            burst = b"".join(proto.data_to_send()) * 200
            sock.settimeout(2.0)
            try:
                while time.monotonic() < until:
                    sock.sendall(burst)
            except OSError:
                pass
            sock.close()
    await asyncio.to_thread(flood)


def _flac(seconds: int, channels: int, rate: int) -> bytes:
    import soundfile

    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", rate, channels, format="FLAC", subtype="PCM_16") as f:
        block = np.zeros((rate, channels), dtype=np.int16)
        for _ in range(seconds):
            f.write(block)
    return buf.getvalue()


async def _uploads(port: int, until: float, audio: bytes, parallel: int) -> None:
    async def one() -> None:
        ws = await _ws(port)
        n = 0
        while time.monotonic() < until:
            n += 1
            await ws.send(wire.encode(wire.Voice(audio, id=f"v{n}")))
            while msgpack.unpackb(await ws.recv()).get("id") != f"v{n}":
                pass
        await ws.close()
    await asyncio.gather(*(one() for _ in range(parallel)))


async def flac_bomb(port: int, until: float) -> None:
    """A small FLAC of 10 minutes of 8-channel silence, four uploads at a time (item 3)."""
    await _uploads(port, until, _flac(600, 8, 48000), 4)


async def heavy_uploads(port: int, until: float) -> None:
    """Valid but costly references: 30 s of 8-channel 192 kHz audio, four at a time."""
    await _uploads(port, until, _flac(30, 8, 192000), 4)


async def dense_text(port: int, until: float) -> None:
    """Two streams of 240 CJK characters (85 s of speech in one segment before; item 5)."""
    async def one() -> None:
        ws = await _ws(port)
        while time.monotonic() < until:
            await ws.send(wire.encode(wire.Start(text=CJK_240, format="s16")))
            while not isinstance(wire.read(await ws.recv()), (wire.Ended, wire.Error)):
                pass
        await ws.close()
    await asyncio.gather(one(), one())


async def hostile_normalize(port: int, until: float) -> None:
    """5,000-character texts that are slow to normalise (item 6)."""
    texts = ["我有" + "１２３４５" * 990, "1" * 4999, "$12.34 on 2024-01-02. " * 220]
    ws = await _ws(port)
    n = 0
    while time.monotonic() < until:
        n += 1
        await ws.send(wire.encode(wire.Start(text=texts[n % 3], options={"normalize": True, "max_len": 4})))
        while not isinstance(wire.read(await ws.recv()), (wire.Ended, wire.Error)):
            pass
    await ws.close()


async def costly_frames(port: int, until: float) -> None:
    """2 MiB frames of two million empty maps, at the message rate (item 7)."""
    frame = b"\xdd" + (2_000_000).to_bytes(4, "big") + b"\x80" * 2_000_000
    ws = await _ws(port)
    reader = asyncio.create_task(_drain_forever(ws))
    while time.monotonic() < until:
        await ws.send(frame)
        await asyncio.sleep(0.025)
    reader.cancel()
    await ws.close()


async def slot_hog(port: int, until: float) -> None:
    """One connection opens 8 long streams, 8 more connections do the same (item 8)."""
    sockets = []
    for _ in range(9):
        ws = await _ws(port)
        for n in range(8):
            await ws.send(wire.encode(wire.Start(id=f"h{n}", text=LONG_TEXT)))
        sockets.append(asyncio.create_task(_drain_forever(ws)))
        await asyncio.sleep(0.2)
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    for task in sockets:
        task.cancel()


async def voice_churn(port: int, until: float) -> None:
    """Registrations and deletions as fast as one connection may (item 9)."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, 0.1 * np.sin(np.arange(16000) / 10).astype(np.float32), 16000, format="WAV")
    await _uploads(port, until, buf.getvalue(), 1)


async def half_open(port: int, until: float) -> None:
    """1,100 HTTP requests that never finish their headers (smaller items)."""
    await asyncio.to_thread(_hold_requests, port, until, b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")


def _hold_requests(port: int, until: float, sent: bytes, count: int = 1100) -> None:
    """`count` connections that send `sent` and then nothing, held until `until`."""
    held = []
    for _ in range(count):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(ATTACKER_ADDRESS, 0))
            sock.sendall(sent)
            held.append(sock)
        except OSError:
            pass
    time.sleep(max(0.0, until - time.monotonic()))
    for sock in held:
        sock.close()


def _reader_of_nothing(port: int) -> socket.socket:
    """A connection from the attacker with a small receive buffer, which it will never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((ATTACKER_ADDRESS, 0))
    sock.connect(("127.0.0.1", port))
    return sock


async def non_readers(port: int, until: float) -> None:
    """Connections that start long streams and never read."""
    from websockets.asyncio.client import connect

    held = []
    for _ in range(8):
        ws = await connect(f"ws://127.0.0.1:{port}/v1/stream", sock=_reader_of_nothing(port), max_queue=1,
                           max_size=None)
        await ws.send(wire.encode(wire.Start(text=LONG_TEXT, format="f32")))
        held.append(ws)
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    for ws in held:
        ws.transport.abort()


# ------------------------------------------------------------------ Hardening III: the HTTP doors


async def slow_bodies(port: int, until: float) -> None:
    """1,100 speech requests: whole headers, 11 bytes of a 30,000-byte body, then nothing (III.1)."""
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 30000\r\n\r\n" + b'{"input": "')
    await asyncio.to_thread(_hold_requests, port, until, head)


async def unread_speech(port: int, until: float) -> None:
    """24 speech requests for long texts whose clients never read the response (III.2)."""
    body = json.dumps({"input": LONG_TEXT, "response_format": "pcm"}).encode()
    request = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def hold() -> None:
        held = []
        for _ in range(24):
            sock = _reader_of_nothing(port)
            sock.sendall(request)
            held.append(sock)
        time.sleep(max(0.0, until - time.monotonic()))
        for sock in held:
            sock.close()
    await asyncio.to_thread(hold)


def _post(port: int, path: str, body: bytes, headers: dict[str, str], source: str = ATTACKER_ADDRESS,
          timeout: float = 120.0) -> tuple[int, dict[str, str]]:
    """One HTTP POST from `source`: its status and headers (the body is read and dropped)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status, dict(response.getheaders())
    finally:
        conn.close()


async def _in_threads(work: list[Callable[[], None]]) -> None:
    """Each function on a thread of its own, all at once."""
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(len(work)) as pool:
        await asyncio.gather(*(loop.run_in_executor(pool, fn) for fn in work))


def _multipart(audio_bytes: int) -> tuple[bytes, bytes]:
    """A 2 MB multipart body of back-to-back near-boundaries (the parser's slow path)."""
    boundary = b"vox" * 20
    near = b"\r\n--" + boundary[:-1] + b"X"
    filler = near * (audio_bytes // len(near))
    body = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="audio"; filename="a.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\n" + filler + b"\r\n--" + boundary + b"--\r\n")
    return boundary, body


async def multipart_boundaries(port: int, until: float) -> None:
    """Four clients posting 2 MB multipart bodies of near-boundaries to /v1/voices (III.8)."""
    boundary, body = _multipart((2 << 20) - 4096)
    answers: dict[str, int] = {}
    began = time.monotonic()

    def post() -> None:
        while time.monotonic() < until:
            try:
                status, _ = _post(port, "/v1/voices", body,
                                  {"Content-Type": "multipart/form-data; boundary=" + boundary.decode()})
                answers[str(status)] = answers.get(str(status), 0) + 1
            except OSError as exc:
                answers[type(exc).__name__] = answers.get(type(exc).__name__, 0) + 1
                time.sleep(0.2)
    await asyncio.gather(*(asyncio.to_thread(post) for _ in range(4)))
    print(f"multipart_boundaries: {sum(answers.values()) / (time.monotonic() - began):.1f} requests/s, "
          f"answers {answers}", flush=True)


async def upload_flood(port: int, until: float) -> None:
    """60 concurrent uploads of 30 s references over HTTP, from one address, each sent again
    after the `Retry-After` of its refusal (III.7)."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, 0.1 * np.sin(np.arange(30 * 16000) / 10).astype(np.float32), 16000, format="WAV")
    audio = buf.getvalue()

    def post() -> None:
        while time.monotonic() < until:
            try:
                status, headers = _post(port, "/v1/voices", audio, {"Content-Type": "audio/wav"})
            except OSError:                          # cut off while sending (refused early): again
                time.sleep(1.0)
                continue
            if status == 429:                        # again when it says
                time.sleep(float(headers.get("Retry-After") or headers.get("retry-after") or 1))
    # Another owner (the victim's address) registers a 1 s voice now and then: how long it takes.
    one_second = io.BytesIO()
    soundfile.write(one_second, 0.1 * np.sin(np.arange(16000) / 7).astype(np.float32), 16000, format="WAV")
    took: list[float] = []

    def other_owner() -> None:
        while time.monotonic() < until - 1.0:
            time.sleep(1.0)
            started = time.monotonic()
            try:
                status, _ = _post(port, "/v1/voices", one_second.getvalue(), {"Content-Type": "audio/wav"},
                                  source="127.0.0.1")
            except OSError as exc:
                print(f"upload_flood: the other owner's registration failed: {exc}", flush=True)
                continue
            if status == 201:
                took.append(time.monotonic() - started)
            else:
                print(f"upload_flood: the other owner's registration got {status}", flush=True)

    # Threads of their own: the default executor has only a few (cores + 4), and the 60 would be
    # six at a time, the other owner's behind them.
    await _in_threads([post] * 60 + [other_owner])
    if took:
        print(f"upload_flood: another owner's 1 s registration: median {np.median(took):.3f} s, "
              f"longest {max(took):.3f} s ({len(took)} of them)", flush=True)


# name -> (attack, engine it needs)
ATTACKS: dict[str, tuple[Callable[[int, float], Awaitable[None]], str]] = {
    "crash_text": (crash_text, "piper"),
    "ping_flood": (ping_flood, "piper"),
    "flac_bomb": (flac_bomb, "voxcpm"),
    "heavy_uploads": (heavy_uploads, "voxcpm"),
    "dense_text": (dense_text, "piper"),
    "hostile_normalize": (hostile_normalize, "voxcpm"),
    "costly_frames": (costly_frames, "piper"),
    "slot_hog": (slot_hog, "piper"),
    "voice_churn": (voice_churn, "voxcpm"),
    "half_open": (half_open, "piper"),
    "non_readers": (non_readers, "piper"),
    "slow_bodies": (slow_bodies, "piper"),
    "unread_speech": (unread_speech, "piper"),
    "multipart_boundaries": (multipart_boundaries, "voxcpm"),
    "upload_flood": (upload_flood, "voxcpm"),
}


def run_attack(name: str, port: int, seconds: float) -> None:
    attack, _ = ATTACKS[name]
    until = time.monotonic() + seconds

    async def go() -> None:
        while time.monotonic() < until:
            try:
                await attack(port, until)
            except Exception:  # noqa: BLE001 - refused or cut off: the attacker tries again
                await asyncio.sleep(0.2)
    asyncio.run(go())


# ------------------------------------------------------------------ the victim and the probes


@dataclass
class Observed:
    first_audio_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    healthz_s: list[float] = field(default_factory=list)
    healthz_failed: int = 0
    rss_mb: list[float] = field(default_factory=list)
    tree_rss_mb: list[float] = field(default_factory=list)


async def victim(port: int, until: float, seen: Observed, engine: str) -> None:
    options = {"max_len": 40} if engine == "voxcpm" else {}
    while time.monotonic() < until:
        try:
            ws = await _ws(port, source="127.0.0.1")
            async with ws:
                while time.monotonic() < until:
                    sent = time.monotonic()
                    await ws.send(wire.encode(wire.Start(text=VICTIM_TEXT, format="s16", options=options)))
                    last = None
                    while True:
                        message = wire.read(await asyncio.wait_for(ws.recv(), 60))
                        now = time.monotonic()
                        if isinstance(message, wire.AudioChunk):
                            if last is None:
                                seen.first_audio_s.append(now - sent)
                            else:
                                seen.gaps_s.append(now - last)
                            last = now
                        elif isinstance(message, wire.Error):
                            seen.failed.append(message.code)
                            break
                        elif isinstance(message, wire.Ended):
                            break
        except Exception as exc:  # noqa: BLE001 - counted, and the victim connects again
            seen.failed.append(type(exc).__name__)
            await asyncio.sleep(0.5)


def probe(port: int, pid: int, until: float, seen: Observed) -> None:
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
                response.read()
            seen.healthz_s.append(time.monotonic() - started)
        except OSError:
            seen.healthz_failed += 1
        seen.rss_mb.append(_rss_mb(pid))
        seen.tree_rss_mb.append(sum(_rss_mb(p) for p in _process_tree(pid)))
        time.sleep(max(0.0, 0.1 - (time.monotonic() - started)))


def _process_tree(pid: int) -> list[int]:
    """The server and its worker processes (Piper's worker, the decoder, the normaliser)."""
    tree = [pid]
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return tree
    for task in tasks:                    # children belong to the thread that started them
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    tree += _process_tree(int(child))
        except OSError:
            pass
    return tree


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of a process, or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def cpu_split(server_pid: int, attacker_pid: int) -> dict[str, float]:
    """CPU seconds so far: the server's event-loop thread (its main thread), its other threads
    (the engine's among them), its worker processes, the attacker's process, and this one (the
    victim and the probe)."""
    loop = _cpu_s(server_pid, server_pid)
    workers = sum(_cpu_s(p) for p in _process_tree(server_pid)[1:])
    return {"server loop": loop, "server other threads": _cpu_s(server_pid) - loop,
            "server workers": workers, "attacker": _cpu_s(attacker_pid), "victim": _cpu_s(os.getpid())}


def observe(port: int, pid: int, seconds: float, engine: str) -> Observed:
    seen = Observed()
    until = time.monotonic() + seconds
    prober = threading.Thread(target=probe, args=(port, pid, until, seen), daemon=True)
    prober.start()
    asyncio.run(victim(port, until, seen, engine))
    prober.join()
    return seen


# ------------------------------------------------------------------ the server


def serve(engine_name: str, port_file: str, model: str | None = None, device: str = "cpu") -> None:
    from vox_ws.config import Limits, ServerConfig

    from ._transport_server import run_server

    slots = 8
    if engine_name.startswith("voxcpm"):
        from vox_ws.engines.voxcpm.engine import VoxCPMEngine
        from vox_ws.testing.tiny_voxcpm import build

        model = model or str(build(tempfile.mkdtemp(prefix="vox-ws-attacks-"), stop="never"))
        # Each step carries `rows` (8 on a CPU, 32 on a GPU): every stream of `rows` slots (today's
        # policy), or with -deadline of more slots (four times on a CPU; twice on a GPU, where a
        # real-size slot holds 0.6 GB of float32 KV), the rows picked by slack;
        # -compiled: the step compiled (`--compile on`), its graphs kept for the next server.
        rows = 8 if device == "cpu" else 32
        slots = (4 if device == "cpu" else 2) * rows if "deadline" in engine_name else rows
        compiled = "compiled" in engine_name
        engine = VoxCPMEngine(model=model, device=device, slots=slots, step_rows=rows,
                              compile="on" if compiled else "off",
                              compile_cache=os.path.join(tempfile.gettempdir(), "vox-ws-bench-compile-cache"))
    else:
        from vox_ws.engines.piper import PiperEngine

        engine = PiperEngine()
    run_server(engine, 0, ServerConfig(port=0, slots=slots, limits=Limits()), port_file=port_file)


class Server:
    def __init__(self, engine: str, model: str | None = None, device: str = "cpu") -> None:
        """`engine` (see `serve`) in a process of its own; VoxCPM2 from `model` (default: the tiny
        one, built) on `device`."""
        self.engine = engine
        self._port_file = tempfile.mktemp(prefix="vox-ws-port-")
        where = (["--model", model] if model else []) + ["--device", device]
        self.proc = subprocess.Popen(module_command("attacks", "--serve", engine, "--port-file", self._port_file,
                                                    *where), cwd=ROOT)
        # A compiled step compiles every bucket before it listens: minutes on a small CPU.
        deadline = time.monotonic() + (900 if "compiled" in engine else 180)
        while not os.path.exists(self._port_file) or not open(self._port_file).read().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
        self.port = int(open(self._port_file).read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self._port_file)


# ------------------------------------------------------------------ the report


def summarize(name: str, base: Observed, seen: Observed, alive: bool) -> dict[str, Any]:
    def median(values: list[float]) -> float | None:
        return round(float(np.median(values)), 3) if values else None

    base_first = median(base.first_audio_s)
    first = median(seen.first_audio_s)
    healthz_p99 = round(float(np.percentile(seen.healthz_s, 99)) * 1000, 1) if seen.healthz_s else None
    row = {
        "attack": name,
        "survived": alive,
        "victim_first_audio_s": first,
        "victim_first_audio_unloaded_s": base_first,
        "victim_longest_gap_s": round(max(seen.gaps_s), 3) if seen.gaps_s else None,
        "victim_longest_gap_unloaded_s": round(max(base.gaps_s), 3) if base.gaps_s else None,
        "victim_streams": len(seen.first_audio_s),
        "victim_failed": seen.failed,
        "healthz_p99_ms": healthz_p99,
        "healthz_failed": seen.healthz_failed,
        "server_rss_peak_mb": round(max(seen.rss_mb), 1) if seen.rss_mb else None,
        "server_rss_unloaded_mb": round(max(base.rss_mb), 1) if base.rss_mb else None,
        "with_workers_rss_peak_mb": round(max(seen.tree_rss_mb), 1) if seen.tree_rss_mb else None,
        "with_workers_rss_unloaded_mb": round(max(base.tree_rss_mb), 1) if base.tree_rss_mb else None,
    }
    row["targets_met"] = bool(
        alive and row["server_rss_peak_mb"] is not None and row["server_rss_peak_mb"] < 1024
        and healthz_p99 is not None and healthz_p99 < 100 and not seen.healthz_failed
        and first is not None and base_first is not None and first < 3 * base_first
        and row["victim_longest_gap_s"] is not None and row["victim_longest_gap_s"] < 1.0 and not seen.failed)
    return row


def measure(names: list[str], seconds: float, baseline_s: float) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        _, engine = ATTACKS[name]
        server = Server(engine)
        try:
            base = observe(server.port, server.proc.pid, baseline_s, engine)
            attacker = subprocess.Popen(module_command("attacks", "--attack", name,
                                                        "--port", str(server.port), "--seconds",
                                                        str(seconds + 2)), cwd=ROOT)
            time.sleep(2.0)                          # the attack under way first
            cpu_before, started = cpu_split(server.proc.pid, attacker.pid), time.monotonic()
            seen = observe(server.port, server.proc.pid, seconds, engine)
            cpu_after, took = cpu_split(server.proc.pid, attacker.pid), time.monotonic() - started
            attacker.wait(120)
            alive = server.proc.poll() is None
            row = summarize(name, base, seen, alive)
            # Cores used while the victim was measured (1.0: one core the whole time).
            row["cores_used"] = {k: round((cpu_after[k] - cpu_before[k]) / took, 2) for k in cpu_after}
        finally:
            server.stop()
        rows.append(row)
        print(f"{name:18s} survived={row['survived']!s:5s} first audio {row['victim_first_audio_s']} s "
              f"(unloaded {row['victim_first_audio_unloaded_s']}) longest gap {row['victim_longest_gap_s']} s "
              f"(unloaded {row['victim_longest_gap_unloaded_s']}) failed {len(row['victim_failed'])} "
              f"healthz p99 {row['healthz_p99_ms']} ms RSS {row['server_rss_peak_mb']} MB "
              f"(with workers {row['with_workers_rss_peak_mb']} MB, unloaded {row['with_workers_rss_unloaded_mb']}) "
              f"targets {'met' if row['targets_met'] else 'NOT met'}", flush=True)
        print(f"{'':18s} cores used: " + ", ".join(f"{k} {v}" for k, v in row["cores_used"].items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated, of: " + ", ".join(ATTACKS))
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds each attack is measured")
    parser.add_argument("--baseline", type=float, default=8.0, help="seconds the unloaded victim is measured")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--attack", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port_file, args.model, args.device)
        return 0
    if args.attack:
        run_attack(args.attack, args.port, args.seconds)
        return 0
    names = [n.strip() for n in args.attacks.split(",") if n.strip()]
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        parser.error(f"unknown attacks: {unknown}")
    rows = measure(names, args.seconds, args.baseline)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"seconds": args.seconds, "attacks": rows}, out, indent=1)
    return 0 if all(r["targets_met"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
