"""`engines/piper_catalogue.py`: the catalogue of a hostile hub (`attackers.HostileHub`) read
into plain, bounded entries, and what `vox-ws models list --available` prints of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attackers import HostileHub, HubFile
from conftest import WAIT_TIMEOUT


def _entry(name: str, language: dict, **more) -> dict:
    lang, dataset, quality = name.split("-")
    folder = f"{lang.split('_')[0]}/{lang}/{dataset}/{quality}"
    return {"language": language, "quality": quality, "num_speakers": 1,
            "files": {f"{folder}/{name}.onnx": {"size_bytes": 63_000_000},
                      f"{folder}/{name}.onnx.json": {"size_bytes": 4_800}}, **more}


def _list_available(hub_url: str, tmp_path, *more: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(tmp_path / "hf"), VOX_WS_PIPER_VOICES_DIR=str(tmp_path / "voices"),
               HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-m", "vox_ws", "models", "list", "--available", *more], env=env,
                          capture_output=True, timeout=WAIT_TIMEOUT)


@pytest.mark.hardening
def test_what_a_catalogue_says_reaches_the_terminal_as_plain_bounded_lines(tmp_path):
    """Finding 10: `models list --available` printed the catalogue raw: a clear-screen escape in
    a language code, an OSC 52 write to the clipboard and a forged line in a language's name,
    colours in a quality reached the terminal, and one name of 100,000 characters padded every
    line to it (a 1.5 MB catalogue printed 40 MB). Now a language code and a quality are taken
    only where they are such (else the name's), a language's name is plain text of at most 40
    characters, an entry named past 64 characters or listing a size past what the server
    reads, or 10**40 speakers, is skipped: every line printed is plain, at most a short line
    long, one a voice. Then a good voice is listed as the catalogue says it."""
    escapes = {"code": "en_US\x1b[2J\x1b[H", "name_english": "English\x1b]52;c;ZXZpbA==\x07\n"
               "en_US-forged-medium  en_US  English  medium  1 speaker   0.1 MB\u202e\u2028"}
    catalogue = {f"en_US-v{n}-medium": _entry(f"en_US-v{n}-medium", escapes, quality="medium\x1b[31m")
                 for n in range(300)}
    catalogue["en_US-" + "x" * 100_000 + "-medium"] = _entry("en_US-" + "x" * 100_000 + "-medium", escapes)
    catalogue["en_US-speakers-medium"] = _entry("en_US-speakers-medium", escapes, num_speakers=10**40)
    huge = _entry("en_US-huge-medium", escapes)
    huge["files"]["en/en_US/huge/medium/en_US-huge-medium.onnx"]["size_bytes"] = 10**400
    catalogue["en_US-huge-medium"] = huge
    catalogue["de_DE-good-low"] = _entry("de_DE-good-low", {"code": "de_DE", "name_english": "German"})
    document = json.dumps(catalogue).encode()
    with HostileHub({"voices.json": HubFile(document)}) as hub:
        listed = _list_available(hub.url, tmp_path)
        described = _list_available(hub.url, tmp_path, "--json")
    assert listed.returncode == 0 and described.returncode == 0, listed.stderr[-2000:]
    out = listed.stdout
    assert not [c for c in set(out.decode()) if c != "\n" and not c.isprintable()], "a control character printed"
    lines = out.decode().splitlines()
    voices = [line for line in lines if line[:1].islower()]
    assert len(voices) == 301 and not any(line.startswith("en_US-forged") for line in lines)
    assert max(map(len, voices)) <= 170, max(voices, key=len)[:200]     # a name of 64, a language of 40
    for line in voices[:300]:
        code, language, quality = line.split()[1:4]
        assert (code, quality) == ("en_US", "medium") and language.startswith("English") and len(language) <= 40
    assert voices[-1].split()[:5] == ["de_DE-good-low", "de_DE", "German", "low", "1"], voices[-1]
    entries = json.loads(described.stdout)
    assert [v["name"] for v in entries][-1] == "de_DE-good-low" and len(entries) == 301
    assert {v["language"] for v in entries} == {"en_US", "de_DE"} and {v["quality"] for v in entries} == {
        "medium", "low"}
