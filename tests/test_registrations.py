"""`service/voices/registrations.py`: voice uploads waiting, bounded per owner and in all, served in
fair turns."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from attackers import ATTACKER
from conftest import WAIT_TIMEOUT, wait_until
from helpers import GatedVoxCPM, tiny_server, tone_wav


@pytest.mark.hardening
async def test_registrations_wait_bounded_and_the_owner_served_longest_ago_goes_first():
    from vox_ws.engine import Refused
    from vox_ws.service.voices.registrations import RegistrationQueue

    queue = RegistrationQueue(per_owner=3, total=5)
    order: list[str] = []
    release = {name: asyncio.Event() for name in ("a1", "a2", "a3", "b1", "c1")}

    async def register(name: str) -> None:
        registration = queue.admit(name[0])
        try:
            async with registration:
                order.append(name)
                await release[name].wait()
        finally:
            registration.release()

    tasks = [asyncio.create_task(register(name)) for name in ("a1", "a2", "a3")]
    await wait_until(lambda: order == ["a1"])
    with pytest.raises(Refused, match="of yours"):
        queue.admit("a")                                      # its fourth
    tasks += [asyncio.create_task(register(name)) for name in ("b1", "c1")]
    await wait_until(lambda: queue.pending == 5)
    with pytest.raises(Refused, match="5 voice registrations are waiting"):
        queue.admit("d")
    for name in ("a1", "b1", "c1", "a2", "a3"):
        release[name].set()
    await asyncio.gather(*tasks)
    assert order == ["a1", "b1", "c1", "a2", "a3"]           # a's burst waits behind the others
    assert queue.pending == 0


@pytest.mark.hardening
async def test_an_owner_flooding_voice_uploads_is_refused_429_and_another_owner_is_served(start_server, tiny_model):

    server = tiny_server(start_server, tiny_model, "memory")
    gated = GatedVoxCPM(server.server.devices.engines[0])
    service = server.server.service

    def upload(pitch: float, source: str) -> httpx.Response:
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(transport=transport, timeout=WAIT_TIMEOUT) as client:
            return client.post(server.http + "/v1/voices", content=tone_wav(1.0, pitch=pitch),
                               headers={"Content-Type": "audio/wav"})

    flood = [asyncio.create_task(asyncio.to_thread(upload, 200.0 + n, ATTACKER)) for n in range(6)]
    # Two of the attacker's are admitted (one building, held; one waiting); the other four are
    # refused at once, before their bodies are read.
    refused = []
    for task in asyncio.as_completed(flood):
        response = await task
        assert response.status_code == 429 and response.headers["Retry-After"], response.text
        assert response.json()["error"]["code"] == "busy"
        refused.append(response)
        if len(refused) == 4:
            break
    assert service.voices.registrations.pending == 2
    victim = asyncio.create_task(asyncio.to_thread(upload, 330.0, "127.0.0.1"))
    await wait_until(lambda: service.voices.registrations.pending == 3)
    gated.gate.set()
    answered = await victim
    assert answered.status_code == 201, answered.text
    kept = [await task for task in flood if not task.done() or task.result().status_code != 429]
    assert [r.status_code for r in kept] == [201, 201]
    # The victim's voice was built before the attacker's second.
    assert gated.built.index(answered.json()["voice"]) == 1
