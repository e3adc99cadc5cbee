"""The README's framework examples (examples/*.py) run as written against a real server."""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import pytest

from vox_ws.engines.piper import PiperEngine

pytestmark = pytest.mark.frameworks

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(PiperEngine(), slots=2, wyoming="tcp://127.0.0.1:0")


@pytest.mark.parametrize("example", ["pipecat_say.py", "livekit_say.py", "wyoming_say.py"])
def test_example_speaks(server, example, tmp_path):
    out = tmp_path / "out.wav"
    where = ["127.0.0.1", str(server.server.wyoming.port)] if example.startswith("wyoming") else [server.url]
    run = subprocess.run([sys.executable, str(ROOT / "examples" / example), *where,
                          "Hello from an example. It speaks two sentences.", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    with wave.open(str(out)) as f:
        seconds = f.getnframes() / f.getframerate()
    assert 1.5 < seconds < 8, (seconds, run.stdout)
    if example != "wyoming_say.py":          # the frameworks print the timed words
        assert "sentences." in run.stdout
