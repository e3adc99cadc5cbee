"""`service/voices/service.py`: voices registered, owned and deleted; reference audio refused before it
is decoded whole (FLAC bombs, rates, channels)."""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import socket
import urllib.error
import urllib.request

import httpx
import numpy as np
import pytest
import soundfile

from attackers import _rss_mb
from conftest import WAIT_TIMEOUT, connect_client, wait_until
from helpers import GatedVoxCPM, audio_of, drain, service_on, tone_wav, wav
from vox_ws.engine import EndReason, ErrorKind, Refused
from vox_ws.service import ANY_OWNER, Audio, Ended, StreamRequest


@pytest.mark.hardening
def test_piper_refuses_a_voice_upload_before_reading_its_body(piper_server):
    sock = socket.create_connection(("127.0.0.1", piper_server.port))
    sock.sendall(b"POST /v1/voices HTTP/1.1\r\nHost: localhost\r\nContent-Type: audio/wav\r\n"
                 b"Content-Length: 2000000\r\n\r\n")
    sock.settimeout(WAIT_TIMEOUT)
    answer = http.client.HTTPResponse(sock)                             # not a byte of the body sent
    answer.begin()
    assert answer.status == 501
    assert json.loads(answer.read())["error"]["code"] == "unsupported"
    sock.close()


def _flac_bomb(seconds: int, channels: int = 8, rate: int = 48000, declare_length: bool = True) -> bytes:
    """Silence in FLAC: a few bytes a second, whatever the channels (the attack's file)."""
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", rate, channels, format="FLAC", subtype="PCM_16") as f:
        block = np.zeros((rate, channels), dtype=np.int16)
        for _ in range(seconds):
            f.write(block)
    data = bytearray(buf.getvalue())
    if not declare_length:
        # STREAMINFO's 36-bit total sample count (file bytes 21.5-25) set to 0: "unknown".
        data[21] &= 0xF0
        data[22:26] = b"\0\0\0\0"
    return bytes(data)


@pytest.mark.hardening
@pytest.mark.parametrize("declare_length", [True, False])
async def test_a_flac_bomb_is_refused_without_decoding_it_whole(voxcpm_loop, declare_length):
    bomb = _flac_bomb(600, declare_length=declare_length)        # 600 s x 8 channels: 880 MB as float32
    assert len(bomb) < 2 << 20
    service = await service_on(voxcpm_loop)
    before = _rss_mb()
    # Several at once, as the attack did (from four owners: one may have only two waiting):
    # they are decoded one at a time.
    results = await asyncio.gather(*(service.voices.register(bomb, owner=f"token:{n}") for n in range(4)),
                                   return_exceptions=True)
    assert all(isinstance(r, Refused) and r.kind == ErrorKind.TOO_LARGE for r in results), results
    assert _rss_mb() - before < 150
    await service.close()


@pytest.mark.hardening
async def test_voice_audio_outside_the_accepted_rates_and_channels_is_invalid(voxcpm_loop):
    service = await service_on(voxcpm_loop)
    for rate, channels in ((1_000_000, 1), (4000, 1), (16000, 9)):
        buf = io.BytesIO()
        soundfile.write(buf, np.zeros((rate // 2, channels), np.float32), rate, format="WAV")
        with pytest.raises(Refused) as info:
            await service.voices.register(buf.getvalue())
        assert info.value.kind == ErrorKind.INVALID, (rate, channels, info.value.message)
    await service.close()


@pytest.mark.hardening
async def test_voices_belong_to_their_owner_and_no_one_evicts_another(voxcpm_loop):
    service = await service_on(voxcpm_loop, max_voices=4, max_voices_per_owner=2)
    alice = [(await service.voices.register(tone_wav(0.5, pitch=200 + n), owner="token:alice"))["voice"]
             for n in range(3)]
    bob = (await service.voices.register(tone_wav(0.5), owner="token:bob"))["voice"]
    # Alice's third retired her first, nobody else's.
    with pytest.raises(Refused):
        service.open_stream(StreamRequest("Hi.", voice=alice[0]))
    for voice in alice[1:] + [bob]:
        service.open_stream(StreamRequest("Hi.", voice=voice, options={"max_len": 1})).cancel()
    # Bob cannot delete Alice's voice (it looks like no voice at all); Alice and an admin can.
    assert await service.voices.delete(alice[1], owner="token:bob") is False
    assert await service.voices.delete(alice[1], owner="token:alice") is True
    assert await service.voices.delete(alice[2], owner=ANY_OWNER) is True
    # A full server refuses new owners' voices rather than dropping someone's.
    others = {name: (await service.voices.register(tone_wav(0.5), owner=f"token:{name}"))["voice"]
              for name in ("carol", "dave", "erin")}
    with pytest.raises(Refused) as info:
        await service.voices.register(tone_wav(0.5), owner="token:frank")
    # The same audio from the same owner is the same voice (no new one, even when full); the
    # same audio from another owner is another voice.
    assert (await service.voices.register(tone_wav(0.5), owner="token:erin"))["voice"] == others["erin"]
    assert len(set(others.values()) | {bob}) == 4
    assert info.value.kind == ErrorKind.BUSY
    service.open_stream(StreamRequest("Hi.", voice=bob, options={"max_len": 1})).cancel()
    await service.close()


@pytest.mark.hardening
async def test_a_registration_cancelled_mid_build_leaves_no_voice_in_the_engine(voxcpm_loop):
    """Issue 71, found on the way: a registration cancelled (its client gone) while the voice
    thread built its voice left the voice in the engine's book: the thread built it after the
    registration had stopped waiting, and nothing kept in the store stood for it. The build is
    held until the registration is cancelled; once the thread has built it, the voice is taken
    out of the engine. Then the same audio is registered whole and spoken with."""
    service = await service_on(voxcpm_loop)
    engine = service.devices.engines[0]
    gated = GatedVoxCPM(engine)
    try:
        registering = asyncio.ensure_future(service.voices.register(tone_wav(0.5, pitch=410.0), owner="token:a"))
        assert await asyncio.to_thread(gated.entered.wait, WAIT_TIMEOUT)
        registering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await registering
        gated.gate.set()
        await wait_until(lambda: gated.built)
        voice = gated.built[0]
        await wait_until(lambda: not engine.voices.has(voice))
        assert await service.voices.store.get(voice) is None            # nor kept
    finally:
        gated.undo()
    again = await service.voices.register(tone_wav(0.5, pitch=410.0), owner="token:a")
    assert again["voice"] == voice and engine.voices.has(voice)
    events = await drain(service.open_stream(StreamRequest("Hi.", voice=voice, options={"max_len": 2})))
    assert isinstance(events[-1], Ended), events[-1]
    await service.close()


@pytest.mark.hardening
async def test_a_queued_stream_keeps_its_voice_when_the_voice_is_deleted(voxcpm_loop):
    service = await service_on(voxcpm_loop)
    voice = (await service.voices.register(tone_wav(1.0), "A short reference.", owner="token:a"))["voice"]
    options = {"max_len": 4, "seed": 7}
    with_voice = audio_of(await drain(service.open_stream(StreamRequest("Hello there.", voice=voice,
                                                                         options=options))), "f32")
    default = audio_of(await drain(service.open_stream(StreamRequest("Hello there.", options=options))), "f32")
    # Both slots busy: the next stream waits in the queue, and its voice is deleted meanwhile.
    blockers = [service.open_stream(StreamRequest("Hold the slot.", options={"max_len": 2000})) for _ in range(2)]
    for blocker in blockers:
        assert isinstance(await blocker.__anext__(), Audio)
    queued = service.open_stream(StreamRequest("Hello there.", voice=voice, options=options))
    assert queued.queued
    assert await service.voices.delete(voice, owner="token:a") is True
    for blocker in blockers:
        blocker.cancel()
    events = await drain(queued)
    assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.MAX_LEN
    audio = audio_of(events, "f32")
    assert np.max(np.abs(audio - with_voice)) < 1e-4
    assert np.max(np.abs(audio - default)) > 1e-3      # the tiny random model barely hears voices
    await service.close()


@pytest.mark.hardening
async def test_another_token_cannot_delete_a_voice_over_the_wire(start_server, tiny_model):
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    server = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2), tokens=["alpha", "beta"])
    async with connect_client(server, additional_headers={"Authorization": "Bearer alpha"}) as alpha:
        await alpha.send({"type": "voice", "id": "r", "audio": tone_wav(0.5)})
        voice = (await alpha.recv_where(lambda m: m.get("id") == "r"))["voice"]
        async with connect_client(server, additional_headers={"Authorization": "Bearer beta"}) as beta:
            await beta.send({"type": "voice_delete", "id": "d", "voice": voice})
            assert (await beta.recv_where(lambda m: m.get("id") == "d"))["deleted"] is False
        status, _ = _delete(server, voice, "beta")
        assert status == 404
        await alpha.send({"type": "voice_delete", "id": "d", "voice": voice})
        assert (await alpha.recv_where(lambda m: m.get("id") == "d"))["deleted"] is True


def _delete(server, voice: str, token: str) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{server.http}/v1/voices/{voice}", method="DELETE",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.mark.hardening
async def test_a_public_name_that_reads_as_anothers_is_refused(tiny_voxcpm):
    """Hardening VII, 6: `Alloy`, Cyrillic `аlloy` and fullwidth `ａｌｌｏｙ` beside the alias
    `alloy`, and `narrator` beside another owner's public `Narrator`, were all accepted and
    listed to everyone. Names are now compared by their normal form (NFKC, case folded) with
    the server's voices, its aliases and the public voices, and a name mixing scripts (UTS #39,
    highly restrictive) is refused: each a typed 400 (`bad_request` over v1), at registration
    and at PATCH. Names that read as nothing else register, in any one script."""
    def register(name: str, address: str, public: bool = True) -> httpx.Response:
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(transport=transport, base_url=tiny_voxcpm.http, timeout=60) as http:
            return http.post("/v1/voices", params={"name": name, "public": str(public).lower()},
                             content=wav(1.0), headers={"content-type": "audio/wav"})

    made = register("Narrator", "127.0.0.5")
    assert made.status_code == 201, made.text
    for name, why in (("Alloy", "reads as"), ("ａｌｌｏｙ", "reads as"), ("аlloy", "one script"),
                      ("narrator", "another public voice"),
                      ("ＮＡＲＲＡＴＯＲ", "another public voice"),
                      ("Narrаtor", "one script")):
        refused = await asyncio.to_thread(register, name, "127.0.0.6")
        assert refused.status_code == 400 and why in refused.json()["error"]["message"], (name, refused.text)
    private = await asyncio.to_thread(register, "narrator", "127.0.0.6", False)       # its owner's own
    assert private.status_code == 201, private.text
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.6"), base_url=tiny_voxcpm.http,
                      timeout=60) as http:
        patched = http.patch("/v1/voices/narrator", json={"public": True})
    assert patched.status_code == 400 and "another public voice" in patched.json()["error"]["message"]
    async with connect_client(tiny_voxcpm) as c:
        await c.send({"type": "voice", "id": "r", "audio": wav(1.0), "name": "Echo", "public": True})
        answer = await c.recv_where(lambda m: m.get("id") == "r")
        assert answer["type"] == "error" and answer["code"] == "bad_request", answer
    for name in ("Ελένη", "日本語のボイス", "Narrator two"):
        served = await asyncio.to_thread(register, name, "127.0.0.7")
        assert served.status_code == 201, (name, served.text)
    listed = httpx.get(tiny_voxcpm.http + "/v1/audio/voices", timeout=60).json()["voices"]
    assert sorted(v["name"] for v in listed if v["kind"] == "public") == sorted(
        ["Narrator", "Ελένη", "日本語のボイス", "Narrator two"])
    for address, names in (("127.0.0.5", ["Narrator"]), ("127.0.0.6", ["narrator"]),
                           ("127.0.0.7", ["Ελένη", "日本語のボイス", "Narrator two"])):
        with httpx.Client(transport=httpx.HTTPTransport(local_address=address), base_url=tiny_voxcpm.http,
                          timeout=60) as http:
            for name in names:
                assert http.delete(f"/v1/voices/{name}").status_code == 200
