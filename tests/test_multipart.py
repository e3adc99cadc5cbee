"""`transports/multipart.py`: multipart bodies parsed in a process of their own, hostile ones
included."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from attackers import ATTACKER
from conftest import WAIT_TIMEOUT
from helpers import tiny_server, tone_wav


@pytest.mark.hardening
async def test_hostile_multipart_bodies_are_parsed_in_another_process(start_server, tiny_model):
    import os

    server = tiny_server(start_server, tiny_model, "memory")
    boundary = b"vox" * 20
    near = b"\r\n--" + boundary[:-1] + b"X"                   # almost the boundary, over and over
    body = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="audio"; filename="a.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\n" + near * ((2 << 20) // len(near) - 100) + b"\r\n--" + boundary
            + b"--\r\n")
    headers = {"Content-Type": "multipart/form-data; boundary=" + boundary.decode()}

    def post(content: bytes, source: str) -> httpx.Response:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=WAIT_TIMEOUT) as client:
            return client.post(server.http + "/v1/voices", content=content, headers=headers)

    answers = await asyncio.gather(*(asyncio.to_thread(post, body, ATTACKER) for _ in range(2)))
    for answer in answers:                                    # the "audio" is not audio
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "bad_request", answer.text
    executor = server.server.state.multipart._executor
    assert executor is not None and all(pid != os.getpid() for pid in executor._processes)
    def lowest_priority(pid: int) -> bool:                    # SCHED_IDLE (Linux), else nice 19
        if hasattr(os, "SCHED_IDLE"):
            return os.sched_getscheduler(pid) == os.SCHED_IDLE
        return os.getpriority(os.PRIO_PROCESS, pid) == 19
    assert all(lowest_priority(pid) for pid in executor._processes)
    good = httpx.post(server.http + "/v1/voices", files={"audio": ("ref.wav", tone_wav(1.0), "audio/wav")},
                      timeout=WAIT_TIMEOUT)
    assert good.status_code == 201, good.text
