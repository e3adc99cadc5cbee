"""Piper voices fetched by name into the folder a running server serves, and removed, through its
admin routes (`GET /v1/admin/voices/available`, `POST` and `DELETE /v1/admin/voices/{name}`), as
Speaches fetches its models through its API: a real `vox-ws serve` (Piper, its voices folder a
tmp dir) whose hub is the loopback mirror of tests/test_models.py (Olah), or a hostile hub the
test drives (`attackers.HostileHub`: one that stalls, over-sends), and real clients: httpx, the
`wyoming` library, the OpenAI SDK. Each answer comes once the rescan has served (or stopped
serving) the voice: the tests read what follows from the answers, never from time."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info

from attackers import HostileHub, HubFile, kernel_buffers_bytes
from conftest import WAIT_TIMEOUT, start_serve, wait_until

ADMIN, USER = "admin-secret", "user-secret"
KEPT = "en_US-kept-medium"                  # in the folder, and named with --piper-voice
OTHER = "en_US-other-medium"                # in the folder, named by nobody


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path: Path, hub_url: str, *more: str, kept: str = KEPT, **env: str) -> tuple[object, int, Path, int]:
    """`vox-ws serve` on Piper, its voices folder holding two voices, KEPT (named with
    --piper-voice `kept`) and OTHER; its hub `hub_url`, more of its environment `env`; its
    process, port, folder and Wyoming port."""
    folder = tmp_path / "voices"
    folder.mkdir(parents=True)
    for name in (KEPT, OTHER):
        _copy_joe(folder, name)
    environment = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                                     "VOX_WS_PIPER_VOICES_DIR")}
    environment.update(HF_ENDPOINT=hub_url, HF_HOME=str(tmp_path / "hf"), PYTHONUNBUFFERED="1", **env)
    wyoming = _free_port()
    command = [sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", "0",
               "--piper-voices-dir", str(folder), "--piper-voice", kept.format(folder=folder),
               "--piper-voices-poll", "0", "--wyoming", f"tcp://127.0.0.1:{wyoming}", *more]
    proc, port = start_serve(command, tmp_path / "server.log", env=environment)
    return proc, port, folder, wyoming


def _copy_joe(folder: Path, name: str) -> None:
    from vox_ws.engines.piper_voices import bundled

    joe = bundled()
    shutil.copyfile(joe.model_path, folder / f"{name}.onnx")
    shutil.copyfile(joe.config_path, folder / f"{name}.onnx.json")


def _stop(proc) -> None:
    proc.terminate()
    proc.wait(30)


def _admin(method: str, port: int, path: str, token: str | None = ADMIN, **params) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"http://127.0.0.1:{port}{path}", headers=headers, params=params,
                         timeout=WAIT_TIMEOUT)


def _refusal(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error.get("reason", "")


def _listed(port: int) -> list[str]:
    voices = httpx.get(f"http://127.0.0.1:{port}/v1/audio/voices", timeout=WAIT_TIMEOUT,
                       headers={"Authorization": f"Bearer {USER}"}).json()["voices"]
    return [v["id"] for v in voices if v.get("kind") == "builtin"]


async def _described(wyoming_port: int) -> set[str]:
    async with AsyncTcpClient("127.0.0.1", wyoming_port) as wyoming:
        await wyoming.write_event(Describe().event())
        while True:
            event = await asyncio.wait_for(wyoming.read_event(), WAIT_TIMEOUT)
            if Info.is_type(event.type):
                (program,) = Info.from_event(event).tts
                return {voice.name for voice in program.voices}


@pytest.mark.packaging                      # as test_models.py: the hub mirror's own venv (.venv-hub)
async def test_a_voice_fetched_by_name_is_served_at_once_and_one_removed_is_not(hub, tmp_path):
    """Finding 9: a voice pulled while the server ran was not served until a restart, and a
    voice could be fetched only from the command line. The admin token's POST fetches it from
    the catalogue into the served folder and answers once it is served: Wyoming's describe and
    /v1/audio/voices list it and the OpenAI SDK speaks it; DELETE removes it and it is listed no
    more. A voice the catalogue lacks, one the hub lacks, one bigger than the catalogue says, a
    second fetch, a name that is no voice's and a voice named at start are each refused, typed,
    and leave the folder as it was."""
    proc, port, folder, wyoming = _serve(tmp_path, hub, "--token", USER, "--admin-token", ADMIN)
    try:
        # Admin only: 401 without a token, 403 with a client's.
        assert _refusal(_admin("GET", port, "/v1/admin/voices/available", None))[:2] == (401, "unauthorized")
        as_user = _admin("POST", port, "/v1/admin/voices/en_GB-test-medium", USER)
        assert _refusal(as_user)[:2] == (403, "unauthorized")
        available = _admin("GET", port, "/v1/admin/voices/available")
        assert available.status_code == 200, available.text
        catalogue = {v["name"]: v for v in available.json()["voices"]}
        assert set(catalogue) == {"en_GB-test-medium", "en_GB-liar-medium", "de_DE-absent-low"}
        assert catalogue["en_GB-test-medium"]["in_folder"] is False and available.json()["skipped"] == 1
        german = _admin("GET", port, "/v1/admin/voices/available", language="de").json()["voices"]
        assert [v["name"] for v in german] == ["de_DE-absent-low"]

        fetched = _admin("POST", port, "/v1/admin/voices/en_GB-test-medium")
        assert fetched.status_code == 201, fetched.text
        assert fetched.json()["served"] is True and fetched.json()["language"] == "en_GB"
        assert "en_GB-test-medium" in _listed(port)
        assert "en_GB-test-medium" in await _described(wyoming)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=USER, max_retries=0)
        speech = await client.audio.speech.create(model="tts-1", voice="en_GB-test-medium",
                                                  response_format="pcm", input="Fetched while it ran.")
        assert len(speech.content) > 22050
        assert _admin("GET", port, "/v1/admin/voices/available").json()["voices"][0]["in_folder"] is True

        before = sorted(p.name for p in folder.iterdir())
        refusals = {"en_GB-test-medium": (409, "bad_request", "already_present"),
                    "en_US-nobody-medium": (404, "bad_request", "unknown_voice"),
                    "lessac": (400, "bad_request", "bad_name"),
                    "en_GB-liar-medium": (502, "bad_request", "voice_refused"),
                    "de_DE-absent-low": (502, "unavailable", "hub_error")}
        for name, refused in refusals.items():
            assert _refusal(_admin("POST", port, f"/v1/admin/voices/{name}")) == refused, name
        liar = _admin("POST", port, "/v1/admin/voices/en_GB-liar-medium").json()["error"]["message"]
        assert "its catalogue says 1000" in liar
        assert sorted(p.name for p in folder.iterdir()) == before        # nothing placed, no .partial

        kept = _admin("DELETE", port, f"/v1/admin/voices/{KEPT}")
        assert _refusal(kept) == (409, "bad_request", "named_at_start")
        removed = _admin("DELETE", port, "/v1/admin/voices/en_GB-test-medium")
        assert removed.status_code == 200 and removed.json()["served"] is False, removed.text
        assert "en_GB-test-medium" not in _listed(port)
        assert "en_GB-test-medium" not in await _described(wyoming)
        assert sorted(p.name for p in folder.iterdir()) == sorted(f"{name}.onnx{json}" for name in (KEPT, OTHER)
                                                                   for json in ("", ".json"))
        assert _refusal(_admin("DELETE", port, "/v1/admin/voices/en_GB-test-medium"))[2] == "unknown_voice"
        assert _admin("DELETE", port, "/v1/admin/voices/..%2Fserver.log").status_code == 404
        assert _refusal(_admin("DELETE", port, "/v1/admin/voices/.hidden"))[2] == "unknown_voice"

        # Two fetches of one voice at once: one fetches it, the other is refused (409: the fetch
        # is under way, or the voice is there already), whichever comes first.
        url = f"http://127.0.0.1:{port}/v1/admin/voices/en_GB-test-medium"
        admin = {"Authorization": f"Bearer {ADMIN}"}
        async with httpx.AsyncClient(headers=admin, timeout=WAIT_TIMEOUT) as http:
            both = await asyncio.gather(http.post(url), http.post(url))
        assert sorted(r.status_code for r in both) == [201, 409], [r.text for r in both]
        second = next(r for r in both if r.status_code == 409)
        assert _refusal(second)[2] in ("fetch_under_way", "already_present")
        assert "en_GB-test-medium" in _listed(port)
    finally:
        _stop(proc)


@pytest.mark.packaging
def test_a_hub_not_reached_and_a_server_without_the_admin_token_are_refused_typed(tmp_path):
    """A hub that does not answer: the catalogue and a fetch are 503 `hub_unreachable` (the hint
    naming the folder to put the files in), at once, nothing placed. A server without
    --admin-token fetches nothing: 403 for everyone (fetching downloads and writes to disk, an
    operator's act)."""
    closed = f"http://127.0.0.1:{_free_port()}"                      # nothing listens there
    proc, port, folder, _ = _serve(tmp_path, closed, "--admin-token", ADMIN)
    try:
        listing = _admin("GET", port, "/v1/admin/voices/available")
        assert _refusal(listing) == (503, "unavailable", "hub_unreachable"), listing.text
        fetch = _admin("POST", port, "/v1/admin/voices/en_GB-test-medium")
        assert _refusal(fetch) == (503, "unavailable", "hub_unreachable"), fetch.text
        said = fetch.json()["error"]["message"]
        assert "did not answer" in said and str(folder) in said
        assert len(list(folder.iterdir())) == 4
    finally:
        _stop(proc)
    proc, port, _, _ = _serve(tmp_path / "open", closed)
    try:
        for token in (None, ADMIN):
            assert _refusal(_admin("POST", port, "/v1/admin/voices/en_GB-test-medium", token))[:2] == \
                (403, "unauthorized")
    finally:
        _stop(proc)


@pytest.mark.packaging
def test_a_server_without_a_voices_folder_says_so(start_server):
    """An engine that serves no voices folder (Piper given its voices, VoxCPM2) answers 501
    `no_voices_folder`, naming what does."""
    from vox_ws.engines.piper import PiperEngine

    server = start_server(PiperEngine(), admin_tokens=[ADMIN])
    for method, path in (("GET", "/v1/admin/voices/available"),
                         ("POST", "/v1/admin/voices/en_GB-test-medium"),
                         ("DELETE", "/v1/admin/voices/en_GB-test-medium")):
        refused = _admin(method, server.port, path)
        assert _refusal(refused) == (501, "unsupported", "no_voices_folder"), refused.text
        assert "--piper-voices-dir" in refused.json()["error"]["message"]


# ------------------------------------------------------------------ a hostile hub (Hardening VII)


SAID = 4794                                 # the config's bytes, as the hub said them


def _joe_files() -> tuple[bytes, bytes]:
    from vox_ws.engines.piper_voices import bundled

    joe = bundled()
    return Path(joe.config_path).read_bytes(), Path(joe.model_path).read_bytes()


def _paths(dataset: str) -> tuple[str, str]:
    name = f"en_GB-{dataset}-medium"
    return f"en/en_GB/{dataset}/medium/{name}.onnx.json", f"en/en_GB/{dataset}/medium/{name}.onnx"


def _hostile_hub(configs: dict[str, HubFile], models: dict[str, HubFile] | None = None) -> HostileHub:
    """A hub of voices `en_GB-DATASET-medium`, each its config as `configs` says and its model
    joe's (or as `models` says), and a voices.json listing them at the sizes their HEADs say."""
    model = _joe_files()[1]
    files, catalogue = {}, {}
    for dataset, config in configs.items():
        config_path, model_path = _paths(dataset)
        files[config_path], files[model_path] = config, (models or {}).get(dataset, HubFile(model))
        catalogue[f"en_GB-{dataset}-medium"] = {
            "language": {"code": "en_GB", "name_english": "English"}, "quality": "medium", "num_speakers": 1,
            "files": {path: {"size_bytes": files[path].said if files[path].said is not None else len(files[path].body)}
                      for path in (config_path, model_path)}}
    files["voices.json"] = HubFile(json.dumps(catalogue).encode())
    return HostileHub(files)


def _answer_or_error(method: str, port: int, path: str, answers: list) -> None:
    try:
        answers.append(_admin(method, port, path))
    except httpx.HTTPError as exc:                 # the server went first
        answers.append(exc)


def _speaks(port: int, voice: str) -> bool:
    speech = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", timeout=WAIT_TIMEOUT,
                        json={"input": "Served all the same.", "voice": voice, "response_format": "pcm"})
    return speech.status_code == 200 and len(speech.content) > 22050


@pytest.mark.hardening
def test_a_stalled_hub_holds_nothing_but_its_own_fetch_and_never_the_exit(tmp_path):
    """Finding 1: while a fetch's config came a byte a second, a DELETE of another voice got no
    answer in 12 s (the fetch held the routes' one lock across its download), and after SIGTERM
    (`--drain-timeout 1`) the server logged "stopped" at 3.3 s and ran on past 30 s (its
    download, on the loop's executor, held `asyncio.run` and the interpreter's exit) until the
    hub let go. Here the hub sends 100 bytes of the config and then nothing until the test ends,
    and the server's time-out between two reads is an hour: while it holds the fetch, a DELETE of
    another voice is answered (200), the catalogue too, a second fetch of the voice is refused
    `fetch_under_way`, and a stream is spoken; on SIGTERM the process is gone within the drain
    and the shutdown's bound (a hang detector: the hub never lets go first), exit 0, and the
    abandoned download's temporary folder is removed at the exit."""
    from vox_ws.server import SHUTDOWN_BOUND_S

    drain = 1.0
    config_path = _paths("stalled")[0]
    (tmp_path / "tmp").mkdir()
    with _hostile_hub({"stalled": HubFile(_joe_files()[0], get="stall", stall_after=100)}) as hub:
        proc, port, folder, _ = _serve(tmp_path, hub.url, "--admin-token", ADMIN, "--drain-timeout", str(drain),
                                       HF_HUB_DOWNLOAD_TIMEOUT="3600", TMPDIR=str(tmp_path / "tmp"))
        answers: list = []
        fetch = threading.Thread(target=_answer_or_error, args=("POST", port, "/v1/admin/voices/en_GB-stalled-medium",
                                                                answers))
        try:
            fetch.start()
            assert hub.stalled[config_path].wait(WAIT_TIMEOUT)
            removed = _admin("DELETE", port, f"/v1/admin/voices/{OTHER}")
            assert removed.status_code == 200 and removed.json()["served"] is False, removed.text
            assert _admin("GET", port, "/v1/admin/voices/available").status_code == 200
            again = _admin("POST", port, "/v1/admin/voices/en_GB-stalled-medium")
            assert _refusal(again) == (409, "bad_request", "fetch_under_way"), again.text
            assert _speaks(port, KEPT)
            assert list((tmp_path / "tmp").glob("vox-ws-voice-*")), "the download's folder"
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(drain + SHUTDOWN_BOUND_S + 30)
            except subprocess.TimeoutExpired:
                raise AssertionError("the server waited on the hub after SIGTERM") from None
            assert proc.returncode == 0 and not hub.released.is_set()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        fetch.join(WAIT_TIMEOUT)
    assert answers and (not isinstance(answers[0], httpx.Response) or answers[0].status_code != 201), answers
    assert "stopped (exit code 0)" in (tmp_path / "server.log").read_text()
    assert list((tmp_path / "tmp").glob("vox-ws-voice-*")) == []
    assert not (folder / "en_GB-stalled-medium.onnx.json").exists()


@pytest.mark.hardening
def test_a_hub_that_sends_more_than_it_said_is_read_no_further_and_the_next_voice_is_served(tmp_path):
    """Finding 5: the catalogue and the hub's HEAD said the config was 4,794 bytes; its GET sent
    209,719,994, all of them read before the fetch was refused, as 507 `folder_not_writable`.
    Now the fetch reads no further than 4,794 bytes (the hub's send stops within what the
    kernel's buffers hold) and is refused as the hub's error, 502 `hub_error`, nothing placed
    nor kept. Then a good voice of the same hub is fetched and spoken."""
    config = _joe_files()[0]
    assert len(config) == SAID
    configs = {"over": HubFile(config, get="oversend", oversend=256 << 20), "good": HubFile(config)}
    (tmp_path / "tmp").mkdir()
    with _hostile_hub(configs) as hub:
        proc, port, folder, _ = _serve(tmp_path, hub.url, "--admin-token", ADMIN, TMPDIR=str(tmp_path / "tmp"))
        try:
            before = sorted(p.name for p in folder.iterdir())
            over = _admin("POST", port, "/v1/admin/voices/en_GB-over-medium")
            assert _refusal(over) == (502, "unavailable", "hub_error"), over.text
            assert f"sent more than {SAID} bytes" in over.json()["error"]["message"]
            assert hub.answered[_paths("over")[0]].wait(WAIT_TIMEOUT)
            assert hub.sent[_paths("over")[0]] <= SAID + (64 << 10) + kernel_buffers_bytes()
            assert sorted(p.name for p in folder.iterdir()) == before
            assert list((tmp_path / "tmp").glob("vox-ws-voice-*")) == []
            good = _admin("POST", port, "/v1/admin/voices/en_GB-good-medium")
            assert good.status_code == 201 and good.json()["served"] is True, good.text
            assert _speaks(port, "en_GB-good-medium")
        finally:
            _stop(proc)


@pytest.mark.hardening
def test_no_file_a_voice_named_at_start_is_read_from_is_removed_and_no_name_is_too_long(tmp_path):
    """Finding 9: with `--piper-voice narrator=FOLDER/en_US-kept-medium.onnx`, DELETE of
    `narrator` was refused (409) but DELETE of `en_US-kept-medium` removed its files (200), and
    the next start exited 2. Finding 11: a name of 300 characters made the POST and the DELETE
    a 500 (`OSError: File name too long`). Now a removal whose files a voice named at start is
    read from is refused, 409 `named_at_start`, by whatever name, and the files stay; a fetch by
    a name past 64 characters is 400 `bad_name`, a removal 404 `unknown_voice`. Then another
    voice is removed, the narrator speaks, and the voices a start would read are all there."""
    from vox_ws.engines.piper_voices import voice_set

    closed = f"http://127.0.0.1:{_free_port()}"                      # no hub: nothing here asks one
    proc, port, folder, _ = _serve(tmp_path, closed, "--admin-token", ADMIN,
                                   kept=f"narrator={{folder}}/{KEPT}.onnx")
    try:
        for name in ("narrator", KEPT):
            refused = _admin("DELETE", port, f"/v1/admin/voices/{name}")
            assert _refusal(refused) == (409, "bad_request", "named_at_start"), (name, refused.text)
        assert (folder / f"{KEPT}.onnx").is_file() and (folder / f"{KEPT}.onnx.json").is_file()
        long = "en_US-" + "a" * 300 + "-medium"
        assert _refusal(_admin("POST", port, f"/v1/admin/voices/{long}")) == (400, "bad_request", "bad_name")
        assert _refusal(_admin("DELETE", port, f"/v1/admin/voices/{long}")) == (404, "bad_request",
                                                                                  "unknown_voice")
        removed = _admin("DELETE", port, f"/v1/admin/voices/{OTHER}")
        assert removed.status_code == 200 and removed.json()["served"] is False, removed.text
        assert _speaks(port, "narrator")
    finally:
        _stop(proc)
    # What the next start reads (it exited 2 when the file was gone).
    assert "narrator" in [v.name for v in voice_set([f"narrator={folder}/{KEPT}.onnx"], str(folder))]


@pytest.mark.hardening
async def test_a_fetch_past_its_deadline_is_given_up_and_a_removal_never_waits_on_a_fetch(
        start_server, hub_client, tmp_path, monkeypatch):
    """Finding 1, the deadline and the lock: a download has a deadline for the whole (set to
    1 s here: the model's HEAD is held by the hub until the test ends), past which the fetch is
    answered 504 `hub_too_slow` and nothing placed; while a fetch holds the folder (placing a
    voice, held here), a removal is answered at once, 409 `folder_busy`. Then a good voice is
    fetched and spoken, and the given-up download's temporary folder is gone once the hub lets
    go of it."""
    import tempfile

    from vox_ws.engines.hub_download import deadline_for
    from vox_ws.engines.piper import PiperEngine
    from vox_ws.engines.piper_voices import VoiceSource

    folder, staged = tmp_path / "voices", tmp_path / "tmp"
    folder.mkdir()
    staged.mkdir()
    _copy_joe(folder, OTHER)
    monkeypatch.setattr(tempfile, "tempdir", str(staged))
    config, model = _joe_files()
    with _hostile_hub({"slow": HubFile(config), "good": HubFile(config)},
                      models={"slow": HubFile(model, stall_head=True)}) as hub:
        hub_client(hub.url)
        server = start_server(PiperEngine(source=VoiceSource((), str(folder))), admin_tokens=[ADMIN])
        fetches = server.server.service.voice_fetches
        fetches.deadline_s = lambda size: 1.0
        slow = await asyncio.to_thread(_admin, "POST", server.port, "/v1/admin/voices/en_GB-slow-medium")
        assert _refusal(slow) == (504, "unavailable", "hub_too_slow"), slow.text
        assert sorted(p.name for p in folder.iterdir()) == [f"{OTHER}.onnx", f"{OTHER}.onnx.json"]

        held, release = threading.Event(), threading.Event()

        async def hold_the_folder() -> None:
            async with fetches._lock():
                held.set()
                await asyncio.to_thread(release.wait, WAIT_TIMEOUT)

        holding = asyncio.run_coroutine_threadsafe(hold_the_folder(), server.loop)
        assert await asyncio.to_thread(held.wait, WAIT_TIMEOUT)
        busy = await asyncio.to_thread(_admin, "DELETE", server.port, f"/v1/admin/voices/{OTHER}")
        release.set()
        await asyncio.wrap_future(holding)
        assert _refusal(busy) == (409, "bad_request", "folder_busy"), busy.text

        fetches.deadline_s = deadline_for
        good = await asyncio.to_thread(_admin, "POST", server.port, "/v1/admin/voices/en_GB-good-medium")
        assert good.status_code == 201 and good.json()["served"] is True, good.text
        assert await asyncio.to_thread(_speaks, server.port, "en_GB-good-medium")
        removed = await asyncio.to_thread(_admin, "DELETE", server.port, f"/v1/admin/voices/{OTHER}")
        assert removed.status_code == 200, removed.text
    await wait_until(lambda: not list(staged.glob("vox-ws-voice-*")))
