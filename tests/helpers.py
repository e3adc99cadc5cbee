"""What several test modules share and is no fixture: texts, audio made and read back, engines
and servers built a certain way, and the outside programs some tests drive. Fixtures are in
conftest.py; no test module imports another (tests/test_test_layout.py checks it)."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import ipaddress
import json
import os
import re
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from conftest import WAIT_TIMEOUT, connect_client, wait_until
from vox_ws.audio import bytes_to_pcm
from vox_ws.config import Limits
from vox_ws.engines.piper import PiperEngine
from vox_ws.engines.piper_voices import bundled
from vox_ws.service import Audio, StreamService
from vox_ws.transports.proxies import V2_SIGNATURE

# How long a compile of one bucket of the tiny model may take on a loaded 2-core machine before a
# test calls it hung: minutes, not a figure any test depends on.
BACKGROUND_BOUND_S = 900

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ texts

SENTENCE = "The quick brown fox jumps over the lazy dog."
LONG = " ".join(
    f"This is sentence number {i}, which keeps the voice busy for a while." for i in range(1, 13)
)

# ------------------------------------------------------------------ audio made and read back

FRAME_S = 0.01          # how exactly a break's silence is placed and measured


def tone_wav(seconds: float, rate: int = 16000, pitch: float = 180.0, fmt: str = "WAV") -> bytes:
    """A sine tone as a 16-bit file (a voice's reference audio)."""
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32), rate, format=fmt,
                    subtype="PCM_16")
    return buf.getvalue()


def wav(seconds: float, rate: int = 16000, fmt: str = "WAV") -> bytes:
    """The HTTP tests' upload: a 170 Hz tone."""
    return tone_wav(seconds, rate, 170.0, fmt)


def longest_zero_run(pcm: np.ndarray) -> tuple[int, int]:
    """(first sample, length) of the longest run of exact zeros."""
    zero = np.concatenate([[0], (pcm == 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(zero))
    starts, ends = edges[::2], edges[1::2]
    if not len(starts):
        return 0, 0
    longest = int(np.argmax(ends - starts))
    return int(starts[longest]), int(ends[longest] - starts[longest])


def decode_file(data: bytes) -> tuple[np.ndarray, int]:
    """A compressed file decoded by FFmpeg (PyAV): its samples as floats, and its rate."""
    import av

    container = av.open(io.BytesIO(data))
    frames = [frame.to_ndarray().reshape(-1).astype(np.float32) for frame in container.decode(audio=0)]
    rate = container.streams.audio[0].codec_context.sample_rate
    pcm = np.concatenate(frames)
    return (pcm / 32767.0 if np.abs(pcm).max() > 2.0 else pcm), rate


def flac_streaminfo(data: bytes) -> tuple[int, bytes]:
    """A FLAC file's total samples and MD5 of its samples, from its STREAMINFO (the block after
    `fLaC` and the block's 4-byte header: the total in the low 36 bits of its bytes 10-17, the
    MD5 in bytes 18-33; 0 and zeros: unknown)."""
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0
    info = data[8:42]
    return int.from_bytes(info[10:18], "big") & ((1 << 36) - 1), info[18:34]


# ------------------------------------------------------------------ engines and voices


class GatedPiper(PiperEngine):
    """The real Piper voice, whose load waits until the test opens a gate (or fails on demand)."""

    def __init__(self, fail: bool = False, voices=None):
        super().__init__(voices=voices)
        self.gate = threading.Event()
        self.fail = fail

    def load(self):
        assert self.gate.wait(60)
        if self.fail:
            raise RuntimeError("weights are corrupt")
        super().load()


# The second voice: the bundled model with a config of its own (British English, spoken slower).
SLOW_LENGTH_SCALE = 1.7


def make_voice(folder: Path, stem: str = "en_GB-slow-medium", language: str = "en_GB",
               length_scale: float = SLOW_LENGTH_SCALE, rate: int | None = None) -> Path:
    """A Piper voice file in `folder`: the bundled model with a config of its own."""
    joe = bundled()
    config = json.loads(Path(joe.config_path).read_text())
    config["language"] = {**config["language"], "code": language}
    config["inference"]["length_scale"] = length_scale
    if rate is not None:
        config["audio"]["sample_rate"] = rate
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / f"{stem}.onnx"
    model.symlink_to(joe.model_path)
    (folder / f"{stem}.onnx.json").write_text(json.dumps(config))
    return model


def speak_through(runner, text: str, *, seed: int, min_len: int, max_len: int) -> np.ndarray:
    """One request through a runner (`BatchedVoxCPM2`), start to end: its audio."""
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import PrefillInput

    row = runner.prefill(PrefillInput(build_prompt(runner.model, text, None), seed=seed, cfg_value=2.0,
                                      timesteps=4, min_len=min_len, max_len=max_len))
    audio = []
    try:
        while True:
            [(chunk, reason)] = runner.step([row])
            if chunk is not None:
                audio.append(chunk)
            if reason is not None:
                return np.concatenate(audio)
    finally:
        runner.release(row)


# ------------------------------------------------------------------ the stream service, no socket


async def service_on(scheduler, **limits) -> StreamService:
    service = StreamService(scheduler, Limits(**limits))
    await service.start()
    return service


async def drain(stream, timeout=60.0):
    async def take():
        return [event async for event in stream]
    return await asyncio.wait_for(take(), timeout)


def audio_of(events, fmt):
    return np.concatenate([bytes_to_pcm(e.data, fmt) for e in events if isinstance(e, Audio)])


# ------------------------------------------------------------------ servers on one voice store


def tiny_server(start_server, tiny_model, store: str, **limits):
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    return start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2), slots=2,
                        voice_store=store, **limits)


async def register(server, seconds: float = 1.0, pitch: float = 190.0) -> str:
    async with connect_client(server) as c:
        await c.send({"type": "voice", "id": "r", "audio": tone_wav(seconds, pitch=pitch),
                      "transcript": "The reference says this."})
        reply = await c.recv_where(lambda m: m.get("id") == "r")
        assert reply["type"] == "voice", reply
        return reply["voice"]


async def speak(server, voice: str | None, sid: str = "s"):
    async with connect_client(server) as c:
        return await c.speak("Speak in the stored voice.", sid, voice=voice,
                             options={"seed": 9, "max_len": 4})


# ------------------------------------------------------------------ the machine's cgroup


def cgroup(tmp_path, membership: str, files: dict[str, str]):
    """A cgroup file system at `tmp_path/cgroup` holding `files` (path -> text), and the process's
    /proc/self/cgroup saying `membership`."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return root, tmp_path / "membership"


# ------------------------------------------------------------------ balancers: PROXY and HAProxy


def v2(source: str | None, port: int = 40000, tlvs: bytes = b"") -> bytes:
    """A v2 header naming `source`; None: LOCAL (a balancer's health check)."""
    if source is None:
        return V2_SIGNATURE + bytes([0x20, 0x00]) + struct.pack("!H", len(tlvs)) + tlvs
    address = ipaddress.ip_address(source)
    family = 0x11 if address.version == 4 else 0x21
    body = address.packed + ipaddress.ip_address("127.0.0.1" if address.version == 4 else "::1").packed
    body += struct.pack("!HH", port, 8765) + tlvs
    return V2_SIGNATURE + bytes([0x21, family]) + struct.pack("!H", len(body)) + body


CHECK_INTERVAL_S = 0.5          # HAProxy's health checks, as in deploy/haproxy.cfg but faster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Balancer:
    """HAProxy with deploy/haproxy.cfg, its port and replicas substituted."""

    def __init__(self, replicas: list[Any], directory: Path) -> None:
        self.port = free_port()
        config = (ROOT / "deploy" / "haproxy.cfg").read_text()
        config = config.replace("bind 127.0.0.1:8765", f"bind 127.0.0.1:{self.port}")
        config = config.replace("inter 1s", f"inter {int(CHECK_INTERVAL_S * 1000)}ms")
        servers = "\n".join(f"    server {r.name} 127.0.0.1:{r.port} check" for r in replicas)
        config = re.sub(r"(    server r\d .*\n)+", servers + "\n", config)
        # HAProxy's own view of its servers (UP, DOWN), for tests that wait on a health check.
        self.stats_socket = directory / "haproxy.sock"
        stats = f"    stats socket {self.stats_socket} mode 600 level user\n"
        config = config.replace("global\n", "global\n" + stats, 1)
        self.config = directory / "haproxy.cfg"
        self.config.write_text(config)
        check = subprocess.run(["haproxy", "-c", "-f", str(self.config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(self.config)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.url = f"ws://127.0.0.1:{self.port}/v1/stream"
        deadline = time.monotonic() + WAIT_TIMEOUT
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("haproxy did not start")

    def stats(self) -> list[dict[str, str]]:
        """HAProxy's `show stat`: a row per frontend, backend and server, by column name."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(self.stats_socket))
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return list(csv.DictReader(io.StringIO(data.decode().lstrip("# "))))

    def states(self) -> dict[str, str]:
        """Each replica's status as HAProxy's health checks last found it ("UP", "DOWN", ...)."""
        return {row["svname"]: row["status"].split()[0] for row in self.stats()
                if row["pxname"] == "replicas" and row["svname"] not in ("BACKEND", "FRONTEND") and row["status"]}

    async def wait_until_seen(self, replica: str, state: str) -> None:
        """Until HAProxy's health checks have marked `replica` UP or DOWN."""
        await wait_until(lambda: self.states().get(replica) == state)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# ------------------------------------------------------------------ the browser

CHROMIUM = os.environ.get("VOX_WS_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]

# ------------------------------------------------------------------ the hub mirror

# scripts/test.sh installs Olah in a venv of its own: its web stack is pinned apart from ours.
OLAH = ROOT / ".venv-hub" / "bin" / "olah-cli"


def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=test", *args], cwd=cwd,
                   check=True, capture_output=True)


class GatedVoxCPM:
    """An engine's voice builds (the tiny VoxCPM2's), held until the test lets them go (`gate`),
    in the order made (`built`); `entered` is set once one is held. `undo()` gives the engine its
    own `register` back (an engine a module shares)."""

    def __init__(self, engine) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.built: list[str] = []
        self._voices = engine.voices
        self._register = engine.voices.register
        engine.voices.register = self

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.gate.wait(WAIT_TIMEOUT)
        self.built.append(args[-1])
        return self._register(*args, **kwargs)

    def undo(self) -> None:
        del self._voices.register


def catalogue_entry(voices: Path, name: str) -> dict:
    """A voice's entry in piper-voices' voices.json, as that repository writes it: its files'
    sizes and MD5s (those in the mirror; a voice absent there gets made-up ones)."""
    language, dataset, quality = name.split("-")
    folder = f"{language.split('_')[0]}/{language}/{dataset}/{quality}"
    files = {}
    for path in (f"{folder}/{name}.onnx", f"{folder}/{name}.onnx.json", f"{folder}/MODEL_CARD"):
        data = (voices / path).read_bytes() if (voices / path).exists() else b"x" * 1000
        files[path] = {"size_bytes": len(data), "md5_digest": hashlib.md5(data).hexdigest()}
    family, region = language.split("_")
    return {"key": name, "name": dataset, "quality": quality, "num_speakers": 1, "speaker_id_map": {},
            "language": {"code": language, "family": family, "region": region, "name_native": family,
                         "name_english": {"en": "English", "de": "German"}[family],
                         "country_english": region},
            "files": files, "aliases": []}


def top_level_parts(inner: str) -> list[str]:
    """The parts of a map or object literal's inside, split at its top-level commas (JavaScript's
    `type: "x", id, text: a(b, c)`, PROTOCOL.md's `id, voice: "v_…", name?`)."""
    depth, parts, current = 0, [], ""
    for char in inner:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts
