"""The docs as written: every `sh` and `python` block of README.md and docs/USAGE.md runs, in a
fresh folder, against a live Piper server (its address put where the docs say
127.0.0.1:8765, and its Wyoming port where they say 10200). A block that cannot run here says
why by a word after its language, and only these words are taken:

    gpu      needs an NVIDIA GPU and VoxCPM2's weights
    docker   needs a container runtime
    network  needs the internet (a model hub)
    server   starts a server of its own (the test runs one instead)
    setup    sets the machine up (CI runs it: it is how the tests are started)

The folder holds what the blocks name: `book.txt`, `me.wav`, `me.flac`, the repository's
`examples/`, and `an-llm`, a stand-in for the LLM command line a reader pipes from."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/USAGE.md")
SKIPS = {"gpu", "docker", "network", "server", "setup"}
_FENCE = re.compile(r"^```(\w*)[ \t]*(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str, str, str]]:
    """(where, language, skip word, body) of every sh and python block."""
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for match in _FENCE.finditer(text):
            language, word, body = match.groups()
            if language in ("sh", "python"):
                found.append((f"{doc}:{text[:match.start()].count(chr(10)) + 1}", language, word, body))
    return found


def test_every_block_says_what_it_is():
    for where, _, word, _ in blocks():
        assert word in SKIPS | {""}, f"{where}: unknown word {word!r} after the language (known: {sorted(SKIPS)})"
    assert sum(1 for _, _, word, _ in blocks() if not word) >= 15


@pytest.fixture(scope="module")
def live(start_server, tmp_path_factory):
    from vox_ws.engines.piper import PiperEngine

    server = start_server(PiperEngine(), wyoming="tcp://127.0.0.1:0")
    folder = tmp_path_factory.mktemp("docs")
    (folder / "book.txt").write_text("It was a bright cold day in April. The clocks were striking thirteen. " * 3)
    tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(16000 * 2) / 16000)
    soundfile.write(folder / "me.wav", tone, 16000)
    soundfile.write(folder / "me.flac", tone, 16000)
    (folder / "examples").symlink_to(ROOT / "examples")
    tools = folder / "bin"
    tools.mkdir()
    (tools / "an-llm").write_text("#!/bin/sh\nprintf 'Once upon a time, a lighthouse keeper kept a light. "
                                  "The end.\\n'\n")
    (tools / "an-llm").chmod(0o755)
    return server, folder


RUNNABLE = [(where, language, body) for where, language, word, body in blocks() if not word]


@pytest.mark.parametrize("where, language, body", RUNNABLE, ids=[where for where, _, _ in RUNNABLE])
def test_the_block_runs_as_written(live, where, language, body):
    server, folder = live
    body = body.replace("127.0.0.1:8765", f"127.0.0.1:{server.port}")
    body = body.replace("127.0.0.1 10200", f"127.0.0.1 {server.server.wyoming.port}")
    # The commands' own default server address, where a reader whose server is elsewhere sets it.
    env = {**os.environ, "VOX_WS_URL": f"ws://127.0.0.1:{server.port}/v1/stream",
           "PATH": f"{folder / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if language == "sh":
        command = ["bash", "-euo", "pipefail", "-c", body]
    else:
        script = folder / f"block_{re.sub(r'[^a-z0-9]', '_', where.lower())}.py"
        script.write_text(body)
        command = [sys.executable, str(script)]
    run = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{where}:\n{body}\n--- stdout\n{run.stdout[-2000:]}\n--- stderr\n{run.stderr[-3000:]}"
