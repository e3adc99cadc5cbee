"""Piper voices fetched by name into the folder a running server serves, and removed, through its
admin routes (`GET /v1/admin/voices/available`, `POST` and `DELETE /v1/admin/voices/{name}`), as
Speaches fetches its models through its API: a real `vox-ws serve` (Piper, its voices folder a
tmp dir) whose hub is the loopback mirror of tests/test_models.py (Olah), and real clients: httpx,
the `wyoming` library, the OpenAI SDK. Each answer comes once the rescan has served (or stopped
serving) the voice: the tests read what follows from the answers, never from time."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
from pathlib import Path

import httpx
import openai
import pytest
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info

from conftest import WAIT_TIMEOUT, start_serve

pytestmark = pytest.mark.packaging           # as test_models.py: the hub mirror's own venv (.venv-hub)

ADMIN, USER = "admin-secret", "user-secret"
KEPT = "en_US-kept-medium"                  # in the folder, and named with --piper-voice


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path: Path, hub_url: str, *more: str) -> tuple[object, int, Path, int]:
    """`vox-ws serve` on Piper, its voices folder holding one voice named with --piper-voice; its
    hub `hub_url`; its process, port, folder and Wyoming port."""
    from vox_ws.engines.piper_voices import bundled

    folder = tmp_path / "voices"
    folder.mkdir(parents=True)
    joe = bundled()
    shutil.copyfile(joe.model_path, folder / f"{KEPT}.onnx")
    shutil.copyfile(joe.config_path, folder / f"{KEPT}.onnx.json")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                             "VOX_WS_PIPER_VOICES_DIR")}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(tmp_path / "hf"), PYTHONUNBUFFERED="1")
    wyoming = _free_port()
    command = [sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", "0",
               "--piper-voices-dir", str(folder), "--piper-voice", KEPT, "--piper-voices-poll", "0",
               "--wyoming", f"tcp://127.0.0.1:{wyoming}", *more]
    proc, port = start_serve(command, tmp_path / "server.log", env=env)
    return proc, port, folder, wyoming


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
        assert sorted(p.name for p in folder.iterdir()) == [f"{KEPT}.onnx", f"{KEPT}.onnx.json"]
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
        assert sorted(p.name for p in folder.iterdir()) == [f"{KEPT}.onnx", f"{KEPT}.onnx.json"]
    finally:
        _stop(proc)
    proc, port, _, _ = _serve(tmp_path / "open", closed)
    try:
        for token in (None, ADMIN):
            assert _refusal(_admin("POST", port, "/v1/admin/voices/en_GB-test-medium", token))[:2] == \
                (403, "unauthorized")
    finally:
        _stop(proc)


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
