"""`engines/hub_download.py` and `engines/piper_hub.py`: a file of the hub downloaded within its
bounds whatever the hub does (more bytes than it said, fewer, a byte at a time, nothing at all),
and stopped by another thread; a voice pulled by name, and a hub that over-sends. Against a
hostile hub on loopback (`attackers.HostileHub`) that the tests drive: what a hub sends, when,
and a clock the hub moves, so every bound is passed by construction, never by time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attackers import HostileHub, HubFile, kernel_buffers_bytes
from conftest import WAIT_TIMEOUT

SAID = 4794                                     # the config: 4,794 bytes by its HEAD
OVERSENT = 256 << 20                            # what a hostile GET sends instead


def _url(hub: HostileHub, path: str) -> str:
    return f"{hub.url}{HostileHub.PREFIX}main/{path}"


class _HubClock:
    """A clock the hub moves: a second for each byte it sends."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += 1.0


@pytest.mark.hardening
def test_a_download_reads_no_further_than_the_hub_said_or_may_send(hub_client, tmp_path):
    """Finding 5: a GET was read whole whatever it sent (huggingface_hub compares sizes after:
    209,719,994 bytes for a config its HEAD said was 4,794). Now a download reads at most what
    the HEAD said: a GET that sends more is read no further (the hub's send stops within what the
    kernel's buffers hold), one that declares more is refused unread, one that sends fewer is the
    hub's error, and one the HEAD says is bigger than the caller's bound is never asked for. Then
    a good file comes whole."""
    from vox_ws.engines.hub_download import HubMisbehaved, TooLarge, Transfer, download

    body = b"c" * SAID
    files = {"over.json": HubFile(body, get="oversend", oversend=OVERSENT),
             "declared.json": HubFile(body, get="oversend", oversend=OVERSENT, declared=OVERSENT),
             "short.json": HubFile(body[:100], said=SAID),
             "big.json": HubFile(body),
             "good.json": HubFile(body)}
    refused = {"over.json": (HubMisbehaved, f"sent more than {SAID} bytes of over.json"),
               "declared.json": (HubMisbehaved, f"is {OVERSENT} bytes, over {SAID} .*refused unread"),
               "short.json": (HubMisbehaved, f"sent 100 bytes of short.json, having said {SAID}"),
               "big.json": (TooLarge, f"big.json is {SAID} bytes")}
    with HostileHub(files) as hub:
        for path, (error, said) in refused.items():
            into = tmp_path / path
            into.mkdir()
            with pytest.raises(error, match=said):
                download(_url(hub, path), path, into, SAID if path != "big.json" else SAID - 1,
                         Transfer(WAIT_TIMEOUT))
            if path == "big.json":
                assert f"GET {path}" not in hub.asked                 # refused by its HEAD, unfetched
            else:
                assert hub.answered[path].wait(WAIT_TIMEOUT)
                assert hub.sent[path] <= SAID + (64 << 10) + kernel_buffers_bytes(), (path, hub.sent[path])
        got = download(_url(hub, "good.json"), "good.json", tmp_path, SAID, Transfer(WAIT_TIMEOUT))
        assert got.read_bytes() == body


@pytest.mark.hardening
def test_a_hub_that_drips_stalls_or_is_stopped_ends_its_download(hub_client, tmp_path, monkeypatch):
    """Finding 1: a hub sending a byte a second never tripped the time-out between two reads,
    and a stalled download ran on as long as the hub held it. Now a download has a deadline for
    the whole: a hub whose clock passes a second a byte is given up at 30 of them (its
    deadline); a hub that sends nothing more is given up at the time-out between two reads (set
    to 0.5 s here; the hub holds the rest until the test ends); a download another thread stops
    ends at its next piece. Then the same file comes whole."""
    from huggingface_hub import constants

    from vox_ws.engines.hub_download import DownloadStopped, HubTooSlow, Transfer, download

    body = b"c" * SAID
    clock = _HubClock()
    stopped = Transfer(WAIT_TIMEOUT)
    bytes_sent = []

    def stop_at_the_tenth_byte() -> None:
        bytes_sent.append(1)
        if len(bytes_sent) == 10:
            stopped.stop.set()

    files = {"drip.json": HubFile(body, get="drip", on_byte=clock.tick),
             "stopped.json": HubFile(body, get="drip", on_byte=stop_at_the_tenth_byte),
             "stall.json": HubFile(body, get="stall", stall_after=100),
             "good.json": HubFile(body)}
    for folder in ("drip", "stopped", "stall"):
        (tmp_path / folder).mkdir()
    with HostileHub(files) as hub:
        with pytest.raises(HubTooSlow, match="within 30 s"):
            download(_url(hub, "drip.json"), "drip.json", tmp_path / "drip", SAID, Transfer(30.0, clock=clock))
        with pytest.raises(DownloadStopped):
            download(_url(hub, "stopped.json"), "stopped.json", tmp_path / "stopped", SAID, stopped)
        monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 0.5)
        with pytest.raises(HubTooSlow, match="stall.json"):
            download(_url(hub, "stall.json"), "stall.json", tmp_path / "stall", SAID, Transfer(WAIT_TIMEOUT))
        assert hub.stalled["stall.json"].wait(WAIT_TIMEOUT) and not hub.released.is_set()
        got = download(_url(hub, "good.json"), "good.json", tmp_path, SAID, Transfer(WAIT_TIMEOUT))
        assert got.read_bytes() == body


def _pull(hub_url: str, tmp_path: Path, name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(tmp_path / "hf"), TMPDIR=str(tmp_path / "tmp"),
               HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-m", "vox_ws", "models", "pull", f"piper:{name}", "--dir",
                           str(tmp_path / "voices")], env=env, capture_output=True, text=True, timeout=WAIT_TIMEOUT)


@pytest.mark.hardening
def test_models_pull_from_a_hub_that_over_sends_places_nothing_and_keeps_nothing(tmp_path):
    """Finding 5 from outside, `vox-ws models pull piper:NAME`: the config the hub's HEAD says is
    4,794 bytes came as 256 MiB, all of it written into the hub's cache before the size was
    compared. Now the pull stops reading at 4,794 bytes and says so in one line (exit 1):
    nothing in the voices folder, nothing left in the temporary folder nor in the hub's cache.
    Then a good voice of the same hub is pulled."""
    from vox_ws.engines.piper_voices import bundled

    joe = bundled()
    config, model = Path(joe.config_path).read_bytes(), Path(joe.model_path).read_bytes()
    files = {"en/en_GB/over/medium/en_GB-over-medium.onnx.json":
             HubFile(config[:SAID], get="oversend", oversend=OVERSENT),
             "en/en_GB/over/medium/en_GB-over-medium.onnx": HubFile(model),
             "en/en_GB/good/medium/en_GB-good-medium.onnx.json": HubFile(config),
             "en/en_GB/good/medium/en_GB-good-medium.onnx": HubFile(model)}
    (tmp_path / "tmp").mkdir()
    with HostileHub(files) as hub:
        refused = _pull(hub.url, tmp_path, "en_GB-over-medium")
        said = [line for line in refused.stderr.splitlines() if line.startswith("vox-ws models pull:")]
        assert refused.returncode == 1 and len(said) == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert f"sent more than {SAID} bytes" in said[0] and "HubMisbehaved" in said[0], said
        assert not (tmp_path / "voices").exists() and list((tmp_path / "tmp").iterdir()) == []
        assert sum(f.stat().st_size for f in (tmp_path / "hf").rglob("*") if f.is_file()) < SAID
        pulled = _pull(hub.url, tmp_path, "en_GB-good-medium")
        assert pulled.returncode == 0, pulled.stderr
    assert sorted(p.name for p in (tmp_path / "voices").iterdir()) == ["en_GB-good-medium.onnx",
                                                                      "en_GB-good-medium.onnx.json"]
    assert (tmp_path / "voices" / "en_GB-good-medium.onnx").read_bytes() == model
    assert list((tmp_path / "tmp").iterdir()) == []
