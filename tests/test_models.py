"""`vox-ws models pull` and `list` against a real hub-compatible server on loopback: Olah (a
self-hosted Hugging Face mirror from PyPI) serving a local git repository of the tiny VoxCPM2,
offline. The pulled checkpoint is then loaded by the engine, as `vox-ws serve` would."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import catalogue_entry
from vox_ws.commands.models import check

pytestmark = pytest.mark.packaging


def _vox_ws(hub: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=hub, HF_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "vox_ws", "models", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_pulled_model_is_listed_and_served_from_the_cache(hub, tmp_path, monkeypatch):
    home = tmp_path / "hf"
    empty = _vox_ws(hub, home, "list")
    assert empty.returncode == 0 and "no checkpoints on disk" in empty.stdout and "models pull" in empty.stdout

    pulled = _vox_ws(hub, home, "pull")
    assert pulled.returncode == 0, pulled.stderr
    assert "serve it on a GPU with: vox-ws serve\n" in pulled.stdout
    listed = json.loads(_vox_ws(hub, home, "list", "--json").stdout)
    assert [(c["name"], c["ok"]) for c in listed] == [("openbmb/VoxCPM2", True)]

    # The server's own offline resolution finds it, and the engine loads it (checks included).
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine
    from vox_ws.engines.voxcpm.loading import resolve_model_path

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(home / "hub"))
    assert resolve_model_path("openbmb/VoxCPM2") == Path(listed[0]["path"])
    engine = VoxCPMEngine(model="openbmb/VoxCPM2", device="cpu", slots=1, compile="off")
    try:
        engine.load()
        assert engine.architecture == "voxcpm2" and engine.sample_rate == 48000
    finally:
        engine.close()

    # A second pull finds everything there already.
    assert _vox_ws(hub, home, "pull").returncode == 0


def test_a_revision_into_a_directory_and_the_errors(hub, tmp_path):
    home, target = tmp_path / "hf", tmp_path / "VoxCPM2-v2"
    pulled = _vox_ws(hub, home, "pull", "openbmb/VoxCPM2", "--revision", "v2", "--dir", str(target))
    assert pulled.returncode == 0, pulled.stderr
    assert f"vox-ws serve --model {target}" in pulled.stdout
    assert json.loads((target / "config.json").read_text())["max_length"] == 4096
    listed = json.loads(_vox_ws(hub, home, "list", "--dir", str(target), "--json").stdout)
    assert [(c["path"], c["ok"]) for c in listed] == [(str(target), True)]

    missing = _vox_ws(hub, home, "pull", "nobody/NoSuchModel")
    assert missing.returncode == 1 and "nobody/NoSuchModel" in missing.stderr
    offline = subprocess.run([sys.executable, "-m", "vox_ws", "models", "pull"], capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 2 and "HF_HUB_OFFLINE" in offline.stderr


def test_what_keeps_a_checkpoint_from_loading_is_named(tiny_model, tmp_path):
    assert check(tiny_model) == []
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])             # an interrupted download
    (broken / "tokenizer.json").unlink()
    problems = check(broken)
    assert any("model.safetensors unreadable" in p and "resumes" in p for p in problems), problems
    assert any("no tokenizer" in p for p in problems), problems
    config = json.loads((tiny_model / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architecture": "voxcpm"}))
    assert any("serves VoxCPM2 only" in p for p in check(broken))
    assert check(tmp_path / "nothing") == ["no config.json"]


def test_a_config_json_too_large_or_not_a_file_is_refused_unread(tiny_model, tmp_path):
    """Hardening V, 15: a 200 MB config.json took `models list` to ~450 MB, and a FIFO in its
    place hung `models list --dir`. It is read through the bounded reader: refused by its size
    before a byte is read, a FIFO refused without waiting; the listing goes on."""
    huge = tmp_path / "models" / "huge"
    shutil.copytree(tiny_model, huge)
    with open(huge / "config.json", "wb") as f:
        f.truncate(200 * 2**20)                      # 200 MB, sparse
    fifo = tmp_path / "models" / "fifo"
    shutil.copytree(tiny_model, fifo)
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    assert any("unreadable (FileTooLarge" in p for p in check(huge)), check(huge)
    assert any("unreadable (NotRegularFile" in p for p in check(fifo)), check(fifo)
    good = tmp_path / "models" / "good"
    shutil.copytree(tiny_model, good)
    run = subprocess.run([sys.executable, "-m", "vox_ws", "models", "list", "--dir", str(tmp_path / "models"),
                          "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode in (0, 1), run.stderr
    listed = {Path(c["path"]).name: c for c in json.loads(run.stdout)}
    assert listed["good"]["ok"] and not listed["huge"]["ok"] and not listed["fifo"]["ok"], listed


@pytest.mark.parametrize("command", [["list"], ["pull"]])
def test_without_the_voxcpm_extra_models_says_so_in_one_line(command):
    """`vox-ws models list` in a Piper-only install was a traceback (`No module named
    'huggingface_hub'`). huggingface_hub made unimportable here, as it is in such an install."""
    script = ("import sys; sys.modules.update(dict.fromkeys(['huggingface_hub', 'safetensors', 'torch'])); "
              "sys.argv = ['vox-ws', 'models', *sys.argv[1:]]; "
              "from vox_ws.commands.cli import main; raise SystemExit(main())")
    run = subprocess.run([sys.executable, "-c", script, *command], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1 and "piper" in run.stderr and "huggingface_hub" in run.stderr


def test_a_piper_voice_is_pulled_by_name_and_served_by_it(hub, tmp_path, start_server):
    """wyoming-piper takes `--voice en_US-lessac-medium` and fetches it; vox-ws had one voice and
    files a user had to find. `models pull piper:NAME` fetches a voice from the Piper voices
    repository (here its mirror) into a voices folder, and the server serves it by its name."""
    from vox_ws.engines.piper import PiperEngine
    from vox_ws.engines.piper_voices import voice_set

    home, folder = tmp_path / "hf", tmp_path / "piper-voices"
    pulled = _vox_ws(hub, home, "pull", "piper:en_GB-test-medium", "--dir", str(folder))
    assert pulled.returncode == 0, pulled.stderr
    assert (folder / "en_GB-test-medium.onnx").is_file() and (folder / "en_GB-test-medium.onnx.json").is_file()
    assert f"--piper-voices-dir {folder}" in pulled.stdout
    assert _vox_ws(hub, home, "pull", "piper:en_GB-test-medium", "--dir", str(folder)).returncode == 0   # again: there
    missing = _vox_ws(hub, home, "pull", "piper:en_US-nobody-medium", "--dir", str(folder))
    assert missing.returncode == 1 and "en_US-nobody-medium" in missing.stderr
    bad = _vox_ws(hub, home, "pull", "piper:lessac", "--dir", str(folder))
    assert bad.returncode == 2 and "LANG_REGION-DATASET-QUALITY" in bad.stderr
    # Served by its name, from the folder and by --piper-voice NAME; it speaks.
    voices = voice_set(["en_GB-test-medium"], str(folder))
    assert [(v.name, v.language) for v in voices] == [("joe", "en_US"), ("en_GB-test-medium", "en_GB")]
    import httpx

    server = start_server(PiperEngine(voices=voices))
    spoken = httpx.post(server.http + "/v1/audio/speech", timeout=60,
                        json={"input": "Hello from the pulled voice.", "voice": "en_GB-test-medium",
                              "response_format": "pcm"})
    assert spoken.status_code == 200 and len(spoken.content) > 10_000


@pytest.mark.hardening
def test_a_piper_voice_whose_config_cannot_be_read_is_refused_and_nothing_placed(hub, tmp_path):
    """A hostile hub's voice (a config of 200,000 nested arrays, or one over 1 MiB) was placed
    (exit 0) in the folder the server serves by default, and every start then exited 1. The
    pull reads the config as the server would, refuses it in one line (exit 1) before placing
    anything, and fetches no model for it; a good voice is pulled after it."""
    home, folder = tmp_path / "hf", tmp_path / "piper-voices"
    folder.mkdir()
    hostile = {"en_US-evil-medium": "nested too deeply", "en_US-huge-medium": "over 1048576 bytes"}
    for name, why in hostile.items():
        refused = _vox_ws(hub, home, "pull", f"piper:{name}", "--dir", str(folder))
        said = [line for line in refused.stderr.splitlines() if line.startswith("vox-ws models pull:")]
        assert refused.returncode == 1 and len(said) == 1, refused.stderr       # (and the hub client's log)
        assert f"piper:{name}: refused" in said[0] and why in said[0] and "nothing was placed" in said[0]
        assert "Traceback" not in refused.stderr
        assert list(folder.iterdir()) == []
        assert not list(home.rglob(f"{name}.onnx"))              # its model never fetched
    pulled = _vox_ws(hub, home, "pull", "piper:en_GB-test-medium", "--dir", str(folder))
    assert pulled.returncode == 0, pulled.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["en_GB-test-medium.onnx",
                                                         "en_GB-test-medium.onnx.json"]


def _home_env(home: Path, hub: str) -> dict[str, str]:
    """A user's environment with its own home (where the default voices folder would be made)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VOX_WS_PIPER_VOICES_DIR")}
    return {**env, "HOME": str(home), "HF_HOME": str(home / "hf"), "HF_ENDPOINT": hub}


def _pull_as(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vox_ws", "models", "pull", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_piper_voice_named_without_piper_is_pointed_to_it(tmp_path):
    """`models pull en_US-lessac-medium` went to the hub as a checkpoint's id: an opaque 401.
    A Piper voice's name is answered at once, asking nothing of the hub: did you mean piper:...?"""
    pulled = _pull_as(_home_env(tmp_path, "http://127.0.0.1:9"), "en_US-lessac-medium")
    assert pulled.returncode == 2 and pulled.stderr.count("\n") == 1, pulled.stderr
    assert "did you mean piper:en_US-lessac-medium?" in pulled.stderr
    assert not (tmp_path / ".local").exists() and not (tmp_path / "hf").exists()


def test_a_hub_that_does_not_answer_is_asked_once_and_the_files_are_named(tmp_path):
    """A hub that did not answer got five retries over 23.5 s of warnings and then an error that
    named no way around it. The voice is asked for once (the hub here keeps the first line of
    each request and hangs up unanswered), and one line says which two files to put where; no
    voices folder is made."""
    listener = socket.create_server(("127.0.0.1", 0))
    asked = []

    def hang_up() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return                                    # the listener closed: the test is over
            with conn:
                request = b""
                while b"\r\n" not in request and (more := conn.recv(4096)):
                    request += more
                asked.append(request.split(b"\r\n")[0].decode())

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    try:
        env = _home_env(tmp_path, f"http://127.0.0.1:{listener.getsockname()[1]}")
        pulled = _pull_as(env, "piper:en_US-lessac-medium")
    finally:
        listener.shutdown(socket.SHUT_RDWR)              # wakes its accept(); close alone does not
        listener.close()
        thread.join()
    assert pulled.returncode == 1 and "Traceback" not in pulled.stderr, pulled.stderr
    assert pulled.stderr.count("\n") == 1 and "Retrying" not in pulled.stderr, pulled.stderr
    voice = "/rhasspy/piper-voices/resolve/main/en/en_US/lessac/medium/en_US-lessac-medium.onnx.json"
    assert [line for line in asked if "piper-voices" in line] == [f"HEAD {voice} HTTP/1.1"], asked
    folder = tmp_path / ".local" / "share" / "vox-ws" / "piper-voices"
    assert "did not answer" in pulled.stderr and f"in {folder}" in pulled.stderr
    assert "put en_US-lessac-medium.onnx and en_US-lessac-medium.onnx.json" in pulled.stderr
    assert "rhasspy/piper-voices/tree/main/en/en_US/lessac/medium" in pulled.stderr
    assert not (tmp_path / ".local").exists()


def test_a_failed_pull_leaves_no_folder_and_no_half_voice(hub, tmp_path):
    """A failed pull left an empty voices folder where the server serves one by default. A voice
    the hub lacks makes no folder; one whose model cannot be placed (here its temporary name is
    taken by a folder) takes its config back out, and a good voice is pulled after it."""
    env = _home_env(tmp_path, hub)
    missing = _pull_as(env, "piper:en_US-nobody-medium")
    assert missing.returncode == 1 and "en_US-nobody-medium" in missing.stderr
    assert not (tmp_path / ".local").exists()

    folder = tmp_path / "piper-voices"
    (folder / "en_GB-test-medium.onnx.partial").mkdir(parents=True)
    unplaced = _pull_as(env, "piper:en_GB-test-medium", "--dir", str(folder))
    said = [line for line in unplaced.stderr.splitlines() if line.startswith("vox-ws models pull:")]
    assert unplaced.returncode == 1 and len(said) == 1 and "Traceback" not in unplaced.stderr, unplaced.stderr
    assert [p.name for p in folder.iterdir()] == ["en_GB-test-medium.onnx.partial"]        # no config alone
    (folder / "en_GB-test-medium.onnx.partial").rmdir()
    assert _pull_as(env, "piper:en_GB-test-medium", "--dir", str(folder)).returncode == 0
    assert sorted(p.name for p in folder.iterdir()) == ["en_GB-test-medium.onnx",
                                                         "en_GB-test-medium.onnx.json"]


def _catalogue_env(hub: str, home: Path, folder: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return {**env, "HF_ENDPOINT": hub, "HF_HOME": str(home), "VOX_WS_PIPER_VOICES_DIR": str(folder), **more}


def _models(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vox_ws", "models", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_voices_that_can_be_pulled_are_listed_with_those_in_the_folder(hub, tmp_path):
    """wyoming-piper and piper-tts list the voices they can download (voices.json); `models pull
    piper:NAME` needed a name found elsewhere. `models list --available` reads the voices
    repository's catalogue through the hub (here its mirror), one voice a line, and marks those
    in the folder the server serves; `--language` picks one language's; offline, the cached
    catalogue is listed."""
    home, folder = tmp_path / "hf", tmp_path / "piper-voices"
    env = _catalogue_env(hub, home, folder)
    listed = _models(env, "list", "--available")
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line.strip()[:1].islower()}
    assert set(lines) == {"en_GB-test-medium", "en_GB-liar-medium", "de_DE-absent-low"}, listed.stdout
    assert lines["en_GB-test-medium"].split()[1:5] == ["en_GB", "English", "medium", "1"]
    assert "63.2 MB" in lines["en_GB-test-medium"] and "in the folder" not in lines["en_GB-test-medium"]
    assert f"puts one in {folder}" in listed.stdout

    assert _models(env, "pull", "piper:en_GB-test-medium").returncode == 0
    described = json.loads(_models(env, "list", "--available", "--json", "--language", "en_GB").stdout)
    assert {(v["name"], v["in_folder"]) for v in described} == {("en_GB-test-medium", True),
                                                                ("en_GB-liar-medium", False)}
    test_voice = next(v for v in described if v["name"] == "en_GB-test-medium")
    assert test_voice["size_bytes"] == sum(p.stat().st_size for p in folder.iterdir())
    german = json.loads(_models(env, "list", "--available", "--json", "--language", "de").stdout)
    assert [(v["name"], v["language_name"], v["quality"]) for v in german] == [
        ("de_DE-absent-low", "German", "low")]

    offline = _models({**env, "HF_HUB_OFFLINE": "1"}, "list", "--available", "--json")     # its cached copy
    assert offline.returncode == 0 and len(json.loads(offline.stdout)) == 3, offline.stderr


def test_the_catalogue_of_a_hub_not_reached_is_one_line_with_a_hint(tmp_path):
    """An unreachable hub, or an offline one without the catalogue cached: one line, no
    traceback, saying where the voices are listed (as `models pull` says where to put them)."""
    with socket.socket() as s:                    # a port nothing listens on: the connection refused
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = _catalogue_env(closed, tmp_path / "hf", tmp_path / "voices")
    unreached = _models(env, "list", "--available")
    assert unreached.returncode == 1 and unreached.stderr.count("\n") == 1, unreached.stderr
    assert "did not answer" in unreached.stderr and "rhasspy/piper-voices/tree/main" in unreached.stderr
    assert "NAME.onnx and NAME.onnx.json" in unreached.stderr
    offline = _models({**env, "HF_HUB_OFFLINE": "1"}, "list", "--available")
    assert offline.returncode == 1 and offline.stderr.count("\n") == 1, offline.stderr
    assert "HF_HUB_OFFLINE is set" in offline.stderr
    assert _models(env, "list", "--language", "en").returncode == 2          # --language without --available


@pytest.mark.hardening
def test_a_catalogue_too_large_or_malformed_is_refused_naming_why(tmp_path):
    """The catalogue is read whole: one over its bound is refused by its size before a byte is
    read, one nested past the parser's depth or that is no map of voices is refused naming why;
    an entry that is no voice's (no voice name, no sizes) is skipped and counted."""
    from vox_ws.engines.piper_catalogue import MAX_CATALOGUE_BYTES, CatalogueUnreadable, read_catalogue

    cases = {"huge": (None, "over"), "nested": (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
             "list": (b"[]", "not a map of voices"), "text": (b"\xff\xfe", "unreadable"),
             "none": (json.dumps({"readme": {}, "en_US-x-medium": {"files": {}}}).encode(), "lists no voice")}
    for name, (data, why) in cases.items():
        path = tmp_path / f"{name}.json"
        if data is None:
            with open(path, "wb") as f:
                f.truncate(MAX_CATALOGUE_BYTES + 1)           # sparse
        else:
            path.write_bytes(data)
        with pytest.raises(CatalogueUnreadable, match=why):
            read_catalogue(path)
    voices = tmp_path / "repo"
    good = catalogue_entry(voices, "en_US-good-medium")
    path = tmp_path / "voices.json"
    path.write_text(json.dumps({"en_US-good-medium": good, "readme": {},
                                "en_US-bad-medium": {**good, "files": []},
                                "en_US-unsized-medium": {**good, "files": {}}}))
    catalogue = read_catalogue(path)
    assert list(catalogue.voices) == ["en_US-good-medium"] and catalogue.skipped == 3
    assert catalogue.voices["en_US-good-medium"].size_bytes == 2000
