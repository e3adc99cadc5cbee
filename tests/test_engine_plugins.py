"""Engines of other packages, installed as any package is: the examples in the tree
(`examples/engine-plugin`: Morse code, the engine of docs/ENGINES.md; `examples/simulated-gpu`:
the benchmarks' simulated device) and a package whose engine raises on import, each built and
installed with pip into a folder of their own, then served by a real `vox-ws serve` process with
that folder on its PYTHONPATH: `--help` and `/v1/info` list them (the broken one with why), a
real v1 client hears Morse code from the engine process, and the broken one stops no one."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from conftest import WAIT_TIMEOUT, start_serve
from helpers import ROOT
from vox_ws import wire
from vox_ws.clients.v1 import VoxError, bytes_to_pcm, connect

pytestmark = pytest.mark.packaging

BROKEN_WHY = "this engine needs a GPU driver that is not installed"
BROKEN = {
    "pyproject.toml": """[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"
[project]
name = "vox-ws-broken"
version = "0.1.0"
[project.entry-points."vox_ws.engines"]
broken = "vox_ws_broken:PLUGIN"
[tool.setuptools]
py-modules = ["vox_ws_broken"]
""",
    "vox_ws_broken.py": f"raise RuntimeError({BROKEN_WHY!r})\n",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example packages and the broken one, built and installed (`pip install --target`,
    without their dependencies: vox-ws and numpy are this environment's) into one folder."""
    work = tmp_path_factory.mktemp("plugins")
    sources = []
    for example in ("engine-plugin", "simulated-gpu"):
        # A copy: pip builds a folder in place, which would leave build/ and *.egg-info in the tree.
        sources.append(shutil.copytree(ROOT / "examples" / example, work / example))
    broken = work / "broken"
    broken.mkdir()
    for name, text in BROKEN.items():
        (broken / name).write_text(text)
    target = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), *map(str, sources), str(broken)],
                   check=True, timeout=WAIT_TIMEOUT)
    return target


def environment(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1"}


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def info(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/info", timeout=10) as response:
            return json.loads(response.read())

    def stop(self) -> int:
        """SIGTERM; its exit code once it has ended, and nothing of its process tree left."""
        tree = [self.proc.pid, *(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))]
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(WAIT_TIMEOUT)
        _, alive = psutil.wait_procs([p for p in map(_process, tree) if p is not None], timeout=WAIT_TIMEOUT)
        assert not alive, alive
        return code


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


@pytest.fixture
def serve(site, tmp_path):
    """`serve(*options)`: a `vox-ws serve` with the installed packages, ready; stopped after."""
    started: list[Served] = []

    def start(*options: str) -> Served:
        log = tmp_path / f"serve-{len(started)}.log"
        command = [sys.executable, "-m", "vox_ws", "serve", "--port", "0", "--drain-timeout", "1", *options]
        proc, port = start_serve(command, log, env=environment(site))
        started.append(Served(proc, port, log))
        return started[-1]

    yield start
    for served in started:
        if served.proc.poll() is None:
            served.stop()


def test_serve_help_lists_each_installed_engine_with_its_settings_and_the_broken_one_with_why(site):
    text = subprocess.run([sys.executable, "-m", "vox_ws", "serve", "--help"], env=environment(site),
                          capture_output=True, text=True, timeout=WAIT_TIMEOUT, check=True).stdout
    assert "engines: auto, morse, piper, simulated-gpu, voxcpm\n" in text
    assert "  morse (from vox-ws-morse 1.0.0): International Morse code" in text
    assert "  simulated-gpu (from vox-ws-simulated-gpu 1.0.0): " in text
    assert "--morse-pitch MORSE_PITCH" in text and "--simulated-gpu-wait-ms" in text
    assert ("engines installed that cannot be served:\n  broken (from vox-ws-broken 0.1.0): "
            f"vox_ws_broken:PLUGIN failed to import: RuntimeError: {BROKEN_WHY}\n") in text


async def test_another_packages_engine_speaks_from_its_engine_process_and_the_broken_one_is_listed(serve):
    """Morse code for "E E" at 20 words a minute: a dot (60 ms) of the --morse-pitch tone, a word's
    gap (7 dots of silence), a dot, a word's gap; each word's time as the engine knows it; a text
    with nothing to send refused before it is queued, in the server's copy of the engine's rules."""
    served = serve("--engine", "morse", "--morse-pitch", "700")
    info = served.info()
    listed = {e["name"]: e for e in info["engines"]}
    assert info["engine"] == "morse" and info["voices"] == ["sine", "square"]
    assert listed["morse"] == {"name": "morse", "source": "vox-ws-morse 1.0.0", "available": True,
                               "error": None, "summary": "International Morse code, a tone per stream (the "
                                                         "example engine of docs/ENGINES.md)"}
    assert listed["simulated-gpu"]["available"] and listed["piper"]["source"] == "built-in"
    assert listed["broken"] == {"name": "broken", "source": "vox-ws-broken 0.1.0", "summary": "",
                                "available": False,
                                "error": f"vox_ws_broken:PLUGIN failed to import: RuntimeError: {BROKEN_WHY}"}
    engine = info["devices"][0]["pid"]
    assert engine != served.proc.pid and psutil.Process(engine).is_running()

    async with connect(served.url) as client:
        assert client.hello.engine == "morse" and client.sample_rate == 24_000
        stream = await client.start_stream("E E", format="f32", word_timestamps=True, options={"wpm": 20})
        audio, words = [], []
        async for message in stream.events():
            if isinstance(message, wire.AudioChunk):
                audio.append(bytes_to_pcm(message.audio, "f32"))
            elif isinstance(message, wire.Words):
                words += message.words
        with pytest.raises(VoxError) as refused:
            await (await client.start_stream("### ~~~", format="f32")).read_all()
    dot = 1440                                                   # 1.2 / 20 s at 24 kHz
    pcm = np.concatenate(audio)
    assert len(pcm) == 16 * dot
    keyed = np.zeros(16 * dot, dtype=bool)
    keyed[:dot] = keyed[8 * dot:9 * dot] = True
    assert not np.any(pcm[~keyed]) and np.sqrt(np.mean(pcm[keyed] ** 2)) > 0.2
    spectrum = np.abs(np.fft.rfft(pcm[:dot]))
    assert abs(np.argmax(spectrum) * 24_000 / dot - 700) <= 24_000 / dot    # the setting's pitch
    assert words == [{"word": "E", "start_s": 0.0, "end_s": 0.06},
                     {"word": "E", "start_s": 0.48, "end_s": 0.54}]
    assert refused.value.code == "bad_request" and "nothing in this text can be sent" in refused.value.message
    assert ("engine 'broken' (from vox-ws-broken 0.1.0) cannot be served: vox_ws_broken:PLUGIN failed to "
            f"import: RuntimeError: {BROKEN_WHY}") in served.log.read_text()
    assert served.stop() == 0


def test_an_engine_that_cannot_be_served_is_refused_by_name_saying_why(site):
    done = subprocess.run([sys.executable, "-m", "vox_ws", "serve", "--engine", "broken", "--port", "0"],
                          env=environment(site), capture_output=True, text=True, timeout=WAIT_TIMEOUT)
    assert done.returncode == 2
    assert done.stderr.endswith("vox-ws serve: engine 'broken' is installed but cannot be served: "
                                f"vox_ws_broken:PLUGIN failed to import: RuntimeError: {BROKEN_WHY}\n")


async def test_the_simulated_gpu_engine_steps_every_row_in_its_process_and_traces_each(serve, tmp_path):
    """The benchmarks' engine: 160 ms of 48 kHz audio per row a step, its steps traced (a line
    each: start, time inside, period, rows, and of the time inside, the launches' and the
    wait's), torch imported in the engine process only."""
    trace = tmp_path / "steps.trace"
    served = serve("--engine", "simulated-gpu", "--simulated-gpu-wait-ms", "1",
                   "--simulated-gpu-trace", str(trace))
    text = "A few seconds of a tone, twice over."
    async with connect(served.url) as client:
        streams = [await client.start_stream(text, format="f32") for _ in range(2)]
        heard = [await stream.read_all() for stream in streams]
    samples = round(len(text) * 0.06 * 48_000)                            # 0.06 s a character
    assert [len(pcm) // 4 for pcm in heard] == [samples] * 2
    engine = served.info()["devices"][0]["pid"]
    maps = {Path(m.path).name for m in psutil.Process(served.proc.pid).memory_maps()}
    assert not any(name.startswith("libtorch") for name in maps)
    assert any(Path(m.path).name.startswith("libtorch") for m in psutil.Process(engine).memory_maps())
    assert served.stop() == 0
    steps = [line.split() for line in trace.read_text().splitlines()]
    assert steps and all(len(step) == 6 for step in steps), steps
    assert sum(int(rows) for _, _, _, rows, _, _ in steps) == 2 * -(-samples // 7680)     # rows of 160 ms
    for _, inside, _, _, launches, wait in steps:
        inside, launches, wait = float(inside), float(launches), float(wait)
        assert inside >= 0.001 and wait >= 0.001 and launches > 0         # the 1 ms wait, after the launches
        assert launches + wait <= inside + 2e-6, (launches, wait, inside)     # each rounded to 1 µs


def test_the_examples_own_tests_pass_against_the_installed_package(site, tmp_path):
    """What docs/ENGINES.md tells a plugin's author to run: its tests, with its own pytest
    configuration, the engine imported from where pip installed it."""
    tests = shutil.copy(ROOT / "examples" / "engine-plugin" / "test_vox_ws_morse.py", tmp_path)
    config = shutil.copy(ROOT / "examples" / "engine-plugin" / "pyproject.toml", tmp_path)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(config),
                           str(tests)], env=environment(site), cwd=tmp_path, capture_output=True, text=True,
                          timeout=WAIT_TIMEOUT)
    assert done.returncode == 0 and re.search(r"\b2 passed\b", done.stdout), done.stdout + done.stderr


def test_the_engines_page_shows_the_example_as_it_is():
    """Each file docs/ENGINES.md quotes (a fenced block under `<!-- PATH -->`), whole and as it is."""
    page = (ROOT / "docs" / "ENGINES.md").read_text()
    quoted = re.findall(r"<!-- (\S+) -->\n```\w+\n(.*?)```\n", page, re.S)
    assert [path for path, _ in quoted] == ["examples/engine-plugin/pyproject.toml",
                                            "examples/engine-plugin/vox_ws_morse.py",
                                            "examples/engine-plugin/test_vox_ws_morse.py"]
    for path, text in quoted:
        assert text == (ROOT / path).read_text(), f"docs/ENGINES.md quotes {path} as it was"
