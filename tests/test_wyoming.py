"""The Wyoming front door (`--wyoming`), driven by the `wyoming` package's own client against a
real server with the Piper voice: describe, one-shot and streaming synthesis, bad events."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.ping import Ping, Pong
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)

from attackers import ATTACKER
from conftest import WAIT_TIMEOUT, connect_client, wait_idle, wait_until
from helpers import FRAME_S, LONG, SENTENCE, GatedPiper, longest_zero_run, make_voice, tone_wav
from vox_ws.engines.piper import PiperEngine
from vox_ws.engines.piper_voices import voice_set
from vox_ws.scheduling.loop import LOADING_RETRY_AFTER_S
from vox_ws.service.voices.aliases import OPENAI_VOICES

READ_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def server(start_server):
    # A pause in a request's text (while a test reads the audio of what came before) never cuts
    # a sentence here, however long reading takes: the tests say where sentences end.
    return start_server(PiperEngine(), slots=2, wyoming="tcp://127.0.0.1:0", input_pause_s=WAIT_TIMEOUT)


def client(server) -> AsyncTcpClient:
    return AsyncTcpClient("127.0.0.1", server.server.wyoming.port)


async def read(c: AsyncTcpClient) -> Event:
    event = await asyncio.wait_for(c.read_event(), READ_TIMEOUT)
    assert event is not None, "the server closed the connection"
    return event


async def read_utterance(c: AsyncTcpClient, first: Event | None = None) -> tuple[AudioStart, np.ndarray]:
    """audio-start, audio-chunk..., audio-stop: the format and the samples."""
    start = first or await read(c)
    assert AudioStart.is_type(start.type), start
    fmt = AudioStart.from_event(start)
    pieces = []
    while True:
        event = await read(c)
        if AudioStop.is_type(event.type):
            break
        assert AudioChunk.is_type(event.type), event
        chunk = AudioChunk.from_event(event)
        assert (chunk.rate, chunk.width, chunk.channels) == (fmt.rate, fmt.width, fmt.channels)
        pieces.append(np.frombuffer(chunk.audio, "<i2"))
    return fmt, np.concatenate(pieces) if pieces else np.zeros(0, "<i2")


async def test_describe_lists_the_voices_and_streaming(server):
    async with client(server) as c:
        await c.write_event(Describe().event())
        info = Info.from_event(await read(c))
    (program,) = info.tts
    assert program.name == "vox-ws" and program.supports_synthesize_streaming
    # The built-in voice, described as wyoming-piper describes it; OpenAI's names, which Home
    # Assistant's picker listed as "alias of joe" 13 times over, are not (no aliases file names them).
    listed = [(v.name, v.description, v.languages) for v in program.voices]
    assert listed == [("joe", "joe (medium)", ["en_US"])]
    # Credited to the engine that speaks (it named OpenBMB/VoxCPM while Piper spoke).
    assert "Piper" in program.voices[0].attribution.name and "piper" in program.voices[0].attribution.url


async def test_text_format_ssml_is_read_as_markup(server):
    """wyoming >= 1.9's `text_format`: "ssml" was ignored, and markup without `<speak>` read
    aloud. Now "ssml" reads it as SSML; "text" reads even a `<speak>` text as written."""
    marked = 'Hello <sub alias="there">over yonder</sub> friend.'

    async def seconds(**fields) -> float:
        async with client(server) as c:
            await c.write_event(Synthesize(text=marked, **fields).event())
            fmt, pcm = await read_utterance(c)
            return len(pcm) / fmt.rate

    as_ssml, as_text = await seconds(text_format="ssml"), await seconds(text_format="text")
    async with client(server) as c:
        await c.write_event(Synthesize(text="Hello there friend.").event())
        fmt, pcm = await read_utterance(c)
        plain = len(pcm) / fmt.rate
    assert as_ssml < plain * 1.3 < as_text                 # the tags are not spoken; as text they are


async def test_one_shot_synthesis_is_one_utterance(server):
    async with client(server) as c:
        await c.write_event(Synthesize(text="Hello from Home Assistant. This is vox-ws.",
                                       voice=SynthesizeVoice(name="joe")).event())
        fmt, pcm = await read_utterance(c)
        assert (fmt.rate, fmt.width, fmt.channels) == (22050, 2, 1)
        assert 1.5 < len(pcm) / fmt.rate < 8
        assert np.sqrt(np.mean((pcm / 32768.0) ** 2)) > 0.01
        # The connection serves the next request.
        await c.write_event(Synthesize(text="Again.").event())
        _, again = await read_utterance(c)
        assert len(again) > 0


async def test_ssml_from_home_assistant_has_its_break_as_exact_silence(server):
    # Piper's s16 output quantises its quietest samples to zero here and there; the break is
    # the one long run of them.

    async with client(server) as c:
        await c.write_event(Synthesize(text='<speak>Lights on.<break time="600ms"/>Done.</speak>').event())
        fmt, pcm = await read_utterance(c)
    run = longest_zero_run(pcm)[1] / fmt.rate
    assert abs(run - 0.6) <= 3 * FRAME_S, run


async def test_a_voice_named_by_its_language_is_the_engines_voice(server):
    async with client(server) as c:
        await c.write_event(Synthesize(text="By language.", voice=SynthesizeVoice(name="en_US")).event())
        _, pcm = await read_utterance(c)
        assert len(pcm) > 0


async def test_streaming_synthesis_speaks_each_sentence_as_it_comes(server):
    async with client(server) as c:
        await c.write_event(SynthesizeStart(voice=SynthesizeVoice(name="joe")).event())
        for piece in ("The first sentence ", "arrives in pieces. ", "And the second "):
            await c.write_event(SynthesizeChunk(text=piece).event())
        # The first sentence is spoken before the request is stopped.
        first = await read(c)
        assert AudioStart.is_type(first.type), first
        _, first_pcm = await read_utterance(c, first)
        assert len(first_pcm) > 0
        await c.write_event(SynthesizeChunk(text="one follows.").event())
        # Home Assistant also sends the whole text for servers that cannot stream: ignored.
        await c.write_event(
            Synthesize(text="The first sentence arrives in pieces. And the second one follows.").event())
        await c.write_event(SynthesizeStop().event())
        _, second_pcm = await read_utterance(c)
        assert len(second_pcm) > 0
        assert SynthesizeStopped.is_type((await read(c)).type)
        # Nothing more: the duplicate text was not spoken.
        await c.write_event(Ping(text="after").event())
        assert Pong.from_event(await read(c)).text == "after"


async def test_first_audio_comes_before_the_request_is_stopped(server):
    async with client(server) as c:
        await c.write_event(SynthesizeStart().event())
        await c.write_event(SynthesizeChunk(text="Speak this now, please. ").event())
        event = await read(c)
        assert AudioStart.is_type(event.type)
        assert AudioChunk.is_type((await read(c)).type)
        await c.write_event(SynthesizeStop().event())
        _ = await read_utterance_rest(c)
        assert SynthesizeStopped.is_type((await read(c)).type)


async def read_utterance_rest(c: AsyncTcpClient) -> int:
    count = 0
    while not AudioStop.is_type((await read(c)).type):
        count += 1
    return count


async def expect_error(c: AsyncTcpClient, code: str) -> str:
    event = await read(c)
    assert Error.is_type(event.type), event
    error = Error.from_event(event)
    assert error.code == code, error
    return error.text


BAD_EVENTS = {
    "unsupported type": ([Event(type="transcribe", data={})], "unsupported", ""),
    "chunk, none open": ([SynthesizeChunk(text="no stream open").event()], "bad_request", "synthesize-start"),
    "stop, none open": ([SynthesizeStop().event()], "bad_request", ""),
    "unknown voice": ([Synthesize(text="x", voice=SynthesizeVoice(name="nobody")).event()], "bad_request", "nobody"),
    "text not a string": ([Event(type="synthesize", data={"text": 42})], "bad_request", ""),
    "blank text": ([Synthesize(text="   ").event()], "bad_request", ""),
    "second start": ([SynthesizeStart().event(), SynthesizeStart().event()], "bad_request", ""),
    "NUL in a chunk": ([SynthesizeStart().event(), SynthesizeChunk(text="a\x00b").event()], "bad_request", ""),
    "not JSON": ([b"this is not json\n"], "bad_request", ""),
    "no type": ([json.dumps({"data": {}}).encode() + b"\n"], "bad_request", ""),
}


@pytest.mark.parametrize("events, code, named", BAD_EVENTS.values(), ids=BAD_EVENTS.keys())
async def test_a_bad_event_gets_an_error_and_the_connection_closes(server, events, code, named):
    """As wyoming-piper: an error, then the connection closed (Home Assistant reads no error
    event and waited on an open connection for `--idle-timeout`, then failed with a 500)."""
    async with client(server) as c:
        for event in events:
            if isinstance(event, bytes):
                c._writer.write(event)
                await c._writer.drain()
            else:
                await c.write_event(event)
        assert named in await expect_error(c, code)
        assert await asyncio.wait_for(c.read_event(), READ_TIMEOUT) is None
    await wait_until(lambda: server.server.wyoming.connections == 0)
    async with client(server) as c:               # the next connection speaks
        await c.write_event(Synthesize(text="Still here.").event())
        _, pcm = await read_utterance(c)
        assert len(pcm) > 0


async def test_home_assistants_client_ends_at_once_on_a_mistyped_voice(server):
    """Home Assistant 2025.4's Wyoming TTS reads events until audio-stop, skipping any it does
    not know (`error` among them), and fails when the connection closes."""
    async with client(server) as c:
        await c.write_event(Synthesize(text="Hello.", voice=SynthesizeVoice(name="jeo")).event())
        skipped = []
        while (event := await asyncio.wait_for(c.read_event(), READ_TIMEOUT)) is not None:
            assert not AudioStart.is_type(event.type)
            skipped.append(event.type)
        assert skipped == ["error"]               # then closed: HA says so instead of waiting


async def expect_stopped(c: AsyncTcpClient) -> None:
    """An input-streaming request with nothing to say ends with synthesize-stopped."""
    event = await read(c)
    assert SynthesizeStopped.is_type(event.type), event


async def test_an_oversized_frame_is_refused_and_closed(server):
    async with client(server) as c:
        c._writer.write(json.dumps({"type": "synthesize", "data_length": 50 << 20}).encode() + b"\n")
        await c._writer.drain()
        await expect_error(c, "too_large")
        assert await asyncio.wait_for(c.read_event(), READ_TIMEOUT) is None
    # The server is unharmed.
    async with client(server) as c:
        await c.write_event(Describe().event())
        assert Info.is_type((await read(c)).type)


async def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
    async with client(server) as c:
        await c.write_event(Synthesize(text="A long text that keeps speaking for a good while. " * 8).event())
        assert AudioStart.is_type((await read(c)).type)
    info = await wait_idle(server)
    assert info["streams_open"] == 0 and info["active"] == 0, info


# ------------------------------------------------------------------ connections the server ends


@pytest.fixture
def strict_server(start_server):
    """Short idle and write-stall time-outs, so reaping shows in a test's time. Each test's own:
    kept for the module, it was a fourth Piper worker (about 270 MB) beside the module's others."""
    return start_server(PiperEngine(), slots=2, wyoming="tcp://127.0.0.1:0",
                        idle_timeout_s=1.0, write_stall_timeout_s=1.0)


async def wait_for_no_wyoming_connections(server) -> None:
    await wait_until(lambda: server.server.wyoming.connections == 0)


async def test_an_idle_connection_is_told_and_closed(strict_server):
    async with client(strict_server) as c:
        await c.write_event(Describe().event())
        assert Info.is_type((await read(c)).type)
        # Nothing more is sent: after idle_timeout_s the server says so and closes.
        await expect_error(c, "timeout")
        assert await asyncio.wait_for(c.read_event(), READ_TIMEOUT) is None
    await wait_for_no_wyoming_connections(strict_server)


@pytest.mark.slow                        # over 4.5 s: the full lane's
async def test_a_connection_inside_a_request_is_not_idle(strict_server):
    async with client(strict_server) as c:
        await c.write_event(SynthesizeStart().event())
        await asyncio.sleep(2.5)                # quiet for over twice idle_timeout_s, but inside a request
        await c.write_event(SynthesizeChunk(text="Still here. ").event())
        await c.write_event(SynthesizeStop().event())
        _, samples = await read_utterance(c)
        assert len(samples) > 0
        await expect_stopped(c)
        # Once the request is over, the quiet counts again.
        await expect_error(c, "timeout")


@pytest.mark.hardening                   # a hostile client: the full lane's
def test_a_client_that_never_reads_loses_its_connection_and_its_slot(strict_server):
    """The socket's buffers fill and the server's writes wait: after write_stall_timeout_s the
    connection is aborted and its stream cancelled, while others are served."""
    import io
    import socket

    from wyoming.event import write_event

    request = io.BytesIO()
    write_event(Synthesize(text="A long text that keeps the voice talking for a good while. " * 40).event(),
                request)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # little room on our side
    sock.connect(("127.0.0.1", strict_server.server.wyoming.port))
    try:
        sock.sendall(request.getvalue())
        deadline = time.monotonic() + WAIT_TIMEOUT
        while time.monotonic() < deadline:
            _, info = strict_server.get("/v1/info")
            if strict_server.server.wyoming.connections == 0 and info["streams_open"] == info["active"] == 0:
                break
            time.sleep(0.05)
        assert strict_server.server.wyoming.connections == 0, "the connection was kept"
        assert info["streams_open"] == 0 and info["active"] == 0, info
        # What was in flight can still be read; then the connection is over.
        sock.settimeout(READ_TIMEOUT)
        with pytest.raises(ConnectionResetError):
            while sock.recv(1 << 16):
                pass
            raise ConnectionResetError("closed")   # an orderly close ends it as well
    finally:
        sock.close()

    async def served() -> None:
        async with client(strict_server) as c:
            await c.write_event(Synthesize(text="Next, please.").event())
            _, samples = await read_utterance(c)
            assert len(samples) > 0

    asyncio.run(served())


@pytest.mark.hardening                   # a client over its cap: the full lane's
async def test_connections_over_the_cap_are_refused_busy(start_server):
    server = start_server(PiperEngine(), slots=2, wyoming="tcp://127.0.0.1:0", max_connections=2)
    async with client(server) as a, client(server) as b:
        for c in (a, b):
            await c.write_event(Ping().event())
            assert Pong.is_type((await read(c)).type)
        async with client(server) as refused:
            await expect_error(refused, "busy")
            assert await asyncio.wait_for(refused.read_event(), READ_TIMEOUT) is None
    async with client(server) as c:               # the two left: room again
        await c.write_event(Ping().event())
        assert Pong.is_type((await read(c)).type)


async def spoken_seconds(server, text: str, voice: str) -> float:
    """How long `voice` takes to say `text` over Wyoming."""
    async with client(server) as c:
        await c.write_event(Synthesize(text=text, voice=SynthesizeVoice(name=voice)).event())
        fmt, pcm = await read_utterance(c)
        return len(pcm) / fmt.rate


async def test_an_alias_carries_a_speed_to_home_assistant(start_server, tmp_path):
    """Home Assistant has no speed field: an alias that carries one (`slow-joe`) slows the voice
    for it, listed in `describe`; a request's own speed multiplies the alias's (OpenAI)."""
    import httpx

    aliases = tmp_path / "aliases.toml"
    aliases.write_text('slow-joe = { voice = "joe", speed = 0.5 }\n')
    slowed = start_server(PiperEngine(), wyoming="tcp://127.0.0.1:0", voice_aliases=str(aliases))
    async with client(slowed) as c:
        await c.write_event(Describe().event())
        listed = {v.name: v for v in Info.from_event(await read(c)).tts[0].voices}
    assert listed["slow-joe"].description == "slow-joe (alias of joe, at 0.5x)" and "alloy" not in listed

    text = "Hello there, how are you today?"
    normal, slow = await spoken_seconds(slowed, text, "joe"), await spoken_seconds(slowed, text, "slow-joe")
    assert 1.6 < slow / normal < 2.4
    body = {"input": "Hello there, how are you today?", "voice": "slow-joe", "response_format": "pcm", "speed": 2.0}
    both = httpx.post(slowed.http + "/v1/audio/speech", json=body, timeout=60)
    assert both.status_code == 200
    assert 0.8 < len(both.content) / 2 / 24000 / normal < 1.25          # 0.5 x 2: the voice's own pace


@pytest.mark.slow
async def test_describe_lists_the_voices_this_address_registered_by_name(start_server, tiny_model):
    """Over Wyoming, VoxCPM2 listed a single `default`, though naming aliases and registered
    voices in a request worked. Now an address sees the voices it registered by name (nobody
    else's), beside the aliases."""
    import httpx
    from wyoming.event import async_read_event, async_write_event

    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    served = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2), slots=2,
                          voice_store="memory", wyoming="tcp://127.0.0.1:0")
    made = httpx.post(served.http + "/v1/voices", params={"name": "grandma"}, content=tone_wav(1.0, pitch=200),
                      headers={"content-type": "audio/wav"}, timeout=60)
    assert made.status_code == 201, made.text

    async def names_seen_from(address: str) -> list[str]:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.server.wyoming.port,
                                                       local_addr=(address, 0))
        await async_write_event(Describe().event(), writer)
        info = Info.from_event(await asyncio.wait_for(async_read_event(reader), WAIT_TIMEOUT))
        writer.close()
        return [v.name for v in info.tts[0].voices]

    mine, theirs = await names_seen_from("127.0.0.1"), await names_seen_from("127.0.0.2")
    assert mine == ["default", "grandma"] and theirs == ["default"]


@pytest.mark.slow
async def test_a_public_voice_is_described_and_spoken_to_a_client_without_a_token(start_server, tiny_model):
    """Issue 60, 7: with --token, a voice cloned with the token could not be named over
    Wyoming (no token there), and the refusal said "or register one", which a Wyoming client
    cannot do. Now a voice its owner made public is listed by `describe` and spoken by
    `synthesize` (the real `wyoming` client, from another address); a private one is neither,
    and the refusal says what a Wyoming client may name."""
    import httpx
    from wyoming.event import async_read_event, async_write_event

    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    served = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2), slots=2,
                          voice_store="memory", wyoming="tcp://127.0.0.1:0", tokens=["alice-token"])
    owner = {"content-type": "audio/wav", "Authorization": "Bearer alice-token"}
    for name, public, pitch in (("narrator", "true", 200), ("diary", "false", 240)):
        made = httpx.post(served.http + "/v1/voices", params={"name": name, "public": public},
                          content=tone_wav(1.0, pitch=pitch), headers=owner, timeout=60)
        assert made.status_code == 201 and made.json()["public"] is (public == "true"), made.text

    async def asked(event: Event) -> list[Event]:
        """What the server answers `event` with, from another address than the owner's: up to
        its audio-stop, or its error."""
        reader, writer = await asyncio.open_connection("127.0.0.1", served.server.wyoming.port,
                                                       local_addr=(ATTACKER, 0))
        answered = []
        try:
            await async_write_event(event, writer)
            while not answered or not (Info.is_type(answered[-1].type) or Error.is_type(answered[-1].type)
                                       or AudioStop.is_type(answered[-1].type)):
                answered.append(await asyncio.wait_for(async_read_event(reader), READ_TIMEOUT))
        finally:
            writer.close()
        return answered

    async def described() -> dict[str, str]:
        info = Info.from_event((await asked(Describe().event()))[-1])
        return {v.name: v.description for v in info.tts[0].voices if v.name != "default"}

    async def synthesized(name: str) -> list[Event]:
        return await asked(Synthesize(text="In the public voice.", voice=SynthesizeVoice(name=name)).event())

    assert await described() == {"narrator": "narrator (public)"}
    spoken = await synthesized("narrator")
    assert AudioStart.is_type(spoken[0].type) and AudioChunk.is_type(spoken[1].type), spoken[:2]
    refused = Error.from_event((await synthesized("diary"))[-1])
    assert refused.code == "bad_request" and "'diary'" in refused.text and "describe" in refused.text
    assert "register" not in refused.text, refused.text
    # Unpublished by its owner (its token, over HTTP): neither listed nor spoken.
    hidden = httpx.patch(served.http + "/v1/voices/narrator", json={"public": False}, headers=owner,
                         timeout=60)
    assert hidden.status_code == 200 and hidden.json()["public"] is False
    assert await described() == {}
    assert Error.is_type((await synthesized("narrator"))[-1].type)


async def test_an_alias_carries_pipers_own_settings(start_server, tmp_path):
    """Piper's synthesis settings (wyoming-piper's --length-scale, --noise-scale,
    --noise-w-scale, --sentence-silence) per request, and so per alias, for clients with no
    field for them (Home Assistant)."""
    aliases = tmp_path / "aliases.toml"
    aliases.write_text('[drawl]\nvoice = "joe"\noptions = { length_scale = 2.0, noise_scale = 0.0 }\n'
                       '[pausing]\nvoice = "joe"\noptions = { sentence_silence = 1.0 }\n')
    served = start_server(PiperEngine(), wyoming="tcp://127.0.0.1:0", voice_aliases=str(aliases))

    text = "One sentence here. And another one."
    normal, drawl, pausing = [await spoken_seconds(served, text, voice) for voice in ("joe", "drawl", "pausing")]
    assert 1.6 < drawl / normal < 2.4
    assert 1.8 < pausing - normal < 2.2                  # a second after each of the two sentences


# ------------------------------------------------------------------ Home Assistant after a reboot


async def test_a_client_that_connects_during_the_load_is_described_every_voice_once_loaded(start_server,
                                                                                           tmp_path):
    """Home Assistant after a reboot: `describe` sent while the engine loaded was answered at once
    with a placeholder (`default`, one language), which Home Assistant keeps for the life of its
    config entry (its picker showed `default`, and `en_GB` was "not supported"); the HTTP lists
    answered 200 with no voice. Now `describe` waits for the load and answers every voice and
    language (and a synthesis sent meanwhile is spoken once loaded), and the lists say 503
    `not_ready` until then."""
    import httpx

    make_voice(tmp_path / "voices", "en_GB-slow-medium")
    held = GatedPiper(voices=voice_set([], str(tmp_path / "voices")))
    served = start_server(held, wait=False, wyoming="tcp://127.0.0.1:0")
    try:
        for path in ("/v1/audio/voices", "/v1/voices"):
            listed = httpx.get(served.http + path, timeout=WAIT_TIMEOUT)
            assert listed.status_code == 503 and listed.json()["error"]["code"] == "not_ready", listed.text
            assert listed.headers["retry-after"] == str(math.ceil(LOADING_RETRY_AFTER_S))
        async with client(served) as c, client(served) as speaker:      # as soon as the port accepts
            await c.write_event(Describe().event())
            await speaker.write_event(Synthesize(text="Hello there.").event())
            # Both have arrived and wait on the load: two waiters on the service's watch of it,
            # beside the voice rescans' own (how often to look is declared once the engine loads).
            await wait_until(lambda: served.server.service._load_settled is not None
                             and len(served.server.service._load_settled._waiters) == 3)
            held.gate.set()
            info = Info.from_event(await read(c))
            assert AudioStart.is_type((await read(speaker)).type)        # spoken, not refused
            while not AudioStop.is_type((await read(speaker)).type):
                pass
    finally:
        held.gate.set()
    described = [(v.name, v.languages) for v in info.tts[0].voices]
    assert described == [("joe", ["en_US"]), ("en_GB-slow-medium", ["en_GB"])]
    listed = httpx.get(served.http + "/v1/audio/voices", timeout=WAIT_TIMEOUT)
    assert listed.status_code == 200
    assert {"joe", "en_GB-slow-medium"} <= {v["id"] for v in listed.json()["voices"]}


async def test_describe_is_not_ready_when_the_load_outlasts_its_wait_or_failed(start_server):
    """Never a placeholder: a load still going after the wait (`idle_timeout_s`; none here), or a
    load that failed, is `error {code: not_ready}` saying so, and the connection closes, so that
    the client asks again."""
    held = GatedPiper()
    served = start_server(held, wait=False, wyoming="tcp://127.0.0.1:0")
    served.server.wyoming.describe_wait_s = 0.0
    try:
        async with client(served) as c:
            await c.write_event(Describe().event())
            error = Error.from_event(await read(c))
            assert error.code == "not_ready" and "loading" in error.text
            assert await asyncio.wait_for(c.read_event(), READ_TIMEOUT) is None
    finally:
        held.gate.set()
    broken = GatedPiper(fail=True)
    broken.gate.set()
    failed = start_server(broken, wait=False, wyoming="tcp://127.0.0.1:0")
    await wait_until(lambda: failed.devices.status == "failed")
    async with client(failed) as c:
        await c.write_event(Describe().event())
        error = Error.from_event(await read(c))
        assert error.code == "not_ready" and "weights are corrupt" in error.text


async def test_home_assistants_picker_offers_each_voice_once_by_its_own_name(start_server, tmp_path):
    """Home Assistant's picker shows each voice's `description`, not its name: with three Piper
    voices its en_US picker had 16 entries, "alias of joe" three times, OpenAI's 13 names dealt
    over the voices. Now: the real voices, described as wyoming-piper describes them (`dataset
    (quality)`, led by the voice's own name where that is not the dataset's), then the aliases
    the aliases file names, each led by its own name. OpenAI's other names are left out of it,
    and still spoken when named; the OpenAI door lists all of them."""
    import httpx

    folder = tmp_path / "voices"
    make_voice(folder, "en_GB-slow-medium")                         # joe's config under another name
    quick = make_voice(folder, "en_US-quick-medium", language="en_US", length_scale=1.0)
    config = quick.with_name("en_US-quick-medium.onnx.json")
    config.write_text(json.dumps({**json.loads(config.read_text()), "dataset": "quick"}))
    aliases = tmp_path / "aliases.toml"
    aliases.write_text('alloy = "en_US-quick-medium"\nslow-joe = { voice = "joe", speed = 0.5 }\n')
    served = start_server(PiperEngine(voices=voice_set([], str(folder))), wyoming="tcp://127.0.0.1:0",
                          voice_aliases=str(aliases))
    async with client(served) as c:
        await c.write_event(Describe().event())
        voices = Info.from_event(await read(c)).tts[0].voices
    # As Home Assistant's WyomingTtsProvider builds its picker: per language, each voice's
    # description (or its name) for the voice id, sorted.
    picker: dict[str, list[tuple[str, str]]] = {}
    for voice in voices:
        for language in voice.languages:
            picker.setdefault(language, []).append((voice.description or voice.name, voice.name))
    assert {language: sorted(entries) for language, entries in picker.items()} == {
        "en_US": [("alloy (alias of en_US-quick-medium)", "alloy"), ("joe (medium)", "joe"),
                  ("quick (medium)", "en_US-quick-medium"), ("slow-joe (alias of joe, at 0.5x)", "slow-joe")],
        "en_GB": [("en_GB-slow-medium (joe, medium)", "en_GB-slow-medium")]}
    assert await spoken_seconds(served, "Not listed, still spoken.", "ash") > 0
    openai_listed = httpx.get(served.http + "/v1/audio/voices", timeout=WAIT_TIMEOUT).json()["voices"]
    assert set(OPENAI_VOICES) <= {v["id"] for v in openai_listed if v["kind"] == "alias"}


async def test_zeroconf_advertises_the_wyoming_door_to_a_browser(start_server):
    """There was no zeroconf: Home Assistant's integration had to be added by host and port.
    With --zeroconf the door is advertised (`_wyoming._tcp`), and a zeroconf browser on the
    same network (here loopback) finds it at its port; it is taken back at shutdown."""
    from zeroconf import ServiceStateChange
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

    served = start_server(PiperEngine(), wyoming="tcp://127.0.0.1:0", zeroconf="vox-ws-test")
    port = served.server.wyoming.port
    browser_zc = AsyncZeroconf(interfaces=["127.0.0.1"])
    changes: list[tuple[str, ServiceStateChange]] = []

    def seen(zeroconf, service_type, name, state_change) -> None:
        changes.append((name, state_change))

    browser = AsyncServiceBrowser(browser_zc.zeroconf, "_wyoming._tcp.local.", handlers=[seen])
    try:
        await wait_until(lambda: ("vox-ws-test._wyoming._tcp.local.", ServiceStateChange.Added) in changes)
        info = await browser_zc.async_get_service_info("_wyoming._tcp.local.", "vox-ws-test._wyoming._tcp.local.",
                                                       timeout=int(WAIT_TIMEOUT * 1000))
        assert info is not None and info.port == port and "127.0.0.1" in info.parsed_addresses()
        served.stop()
        await wait_until(lambda: ("vox-ws-test._wyoming._tcp.local.", ServiceStateChange.Removed) in changes)
    finally:
        await browser.async_cancel()
        await browser_zc.async_close()


def test_zeroconf_without_a_tcp_wyoming_door_is_refused_at_start(start_server):
    with pytest.raises(Exception, match="--zeroconf advertises the Wyoming door"):
        start_server(PiperEngine(), zeroconf="vox-ws-test")


def serve_refused(tmp_path, *options: str, hidden: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`vox-ws serve OPTIONS` in a process of its own, the packages `hidden` not importable there
    (as on an install without the extra): its exit and what it said."""
    hide = "".join(f"sys.modules[{name!r}] = None; " for name in hidden)
    code = f"import sys; {hide}from vox_ws.commands.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "serve", "--engine", "piper", "--port", "0",
                           "--voice-store", "memory", *options], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HOME": str(tmp_path)})


def said_in_one_line(run: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in run.stderr, run.stderr
    refusals = [line for line in run.stderr.splitlines() if line.startswith("vox-ws serve:")]
    assert len(refusals) == 1, run.stderr
    return refusals[0]


def test_the_wyoming_door_without_its_package_is_refused_in_one_line(tmp_path):
    """`--wyoming` (and `--zeroconf`) on an install without the `wyoming` extra stopped the start
    with a 20-line traceback, after the engine had been chosen. Now: one `vox-ws serve:` line
    saying which package and how to install it, exit 1, before any engine starts."""
    door = ["--wyoming", "tcp://127.0.0.1:0"]
    for options, hidden, package in ((door, ("wyoming",), "wyoming"),
                                     ([*door, "--zeroconf", "vox-ws"], ("zeroconf",), "zeroconf")):
        run = serve_refused(tmp_path, *options, hidden=hidden)
        assert run.returncode == 1, run.stderr
        line = said_in_one_line(run)
        assert f"needs the {package} package" in line and "pip install '.[wyoming]'" in line, line
        assert "engine auto" not in run.stderr and "listening" not in run.stderr


def test_zeroconf_without_a_tcp_wyoming_door_is_refused_in_one_line(tmp_path):
    """Contradicting options are a usage error: exit 2, one line, for no --wyoming as for a Unix one."""
    for options in (["--zeroconf", "vox-ws"], ["--zeroconf", "vox-ws", "--wyoming", f"unix://{tmp_path}/w.sock"]):
        run = serve_refused(tmp_path, *options)
        assert run.returncode == 2, run.stderr
        assert said_in_one_line(run) == ("vox-ws serve: --zeroconf advertises the Wyoming door: serve it "
                                         "with --wyoming tcp://HOST:PORT")


def test_a_wyoming_port_taken_is_refused_in_one_line_and_nothing_is_left_running(tmp_path):
    """A Wyoming port another program holds: the HTTP port and the Piper worker had started, and
    the start ended in two tracebacks (the server's, then its worker's broken pipe). Now one line
    naming the door, exit 1, and the worker stopped with it (no traceback of its own)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        uri = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        run = serve_refused(tmp_path, "--wyoming", uri)
    assert run.returncode == 1, run.stderr
    assert said_in_one_line(run).startswith(f"vox-ws serve: --wyoming {uri}: cannot listen: ")


@pytest.fixture(scope="module")
def wyoming_server(start_server):
    return start_server(PiperEngine(), slots=2, wyoming="tcp://127.0.0.1:0", idle_timeout_s=1.0,
                        body_timeout_s=1.0, stream_timeout_s=1.0)


@pytest.fixture(scope="module")
def wyoming_patient(start_server):
    """No idle or body time-out in reach: what a test sees is never cut short by one."""
    return start_server(PiperEngine(), slots=2, wyoming="tcp://127.0.0.1:0", idle_timeout_s=3600.0,
                        body_timeout_s=3600.0, max_connections_per_address=3)


async def wyoming_connection(server, source: str = ATTACKER) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.server.wyoming.port, local_addr=(source, 0))


async def next_event(reader: asyncio.StreamReader):
    from wyoming.event import async_read_event

    return await asyncio.wait_for(async_read_event(reader), WAIT_TIMEOUT)


async def expect_wyoming_error(reader: asyncio.StreamReader, code: str) -> str:
    from wyoming.error import Error

    event = await next_event(reader)
    assert event is not None and Error.is_type(event.type), event
    error = Error.from_event(event)
    assert error.code == code, error
    return error.text


async def assert_wyoming_speaks(server) -> None:
    from wyoming.audio import AudioStart, AudioStop
    from wyoming.event import async_write_event
    from wyoming.tts import Synthesize

    reader, writer = await wyoming_connection(server, "127.0.0.1")
    await async_write_event(Synthesize(text=SENTENCE).event(), writer)
    kinds = []
    while not kinds or not AudioStop.is_type(kinds[-1]):
        kinds.append((await next_event(reader)).type)
    assert AudioStart.is_type(kinds[0]) and len(kinds) > 2, kinds
    writer.close()


@pytest.mark.hardening
async def test_wyoming_frames_that_never_finish_and_requests_gone_quiet_are_closed(wyoming_server):
    from wyoming.event import async_write_event
    from wyoming.tts import SynthesizeStart

    # A header that declares a 1,000-byte payload, and 10 bytes of it.
    reader, writer = await wyoming_connection(wyoming_server)
    writer.write(json.dumps({"type": "ping", "payload_length": 1000}).encode() + b"\n" + b"x" * 10)
    assert "did not follow its header" in await expect_wyoming_error(reader, "timeout")
    assert await next_event(reader) is None
    writer.close()
    # synthesize-start, then silence: the stream times out, and the connection closes with it.
    reader, writer = await wyoming_connection(wyoming_server)
    await async_write_event(SynthesizeStart().event(), writer)
    await expect_wyoming_error(reader, "timeout")                     # the stream's input time-out
    assert await next_event(reader) is None
    writer.close()
    await wait_until(lambda: wyoming_server.server.wyoming.connections == 0)
    await assert_wyoming_speaks(wyoming_server)


@pytest.mark.hardening
async def test_wyoming_connections_are_capped_per_address(wyoming_patient):
    from wyoming.event import async_write_event
    from wyoming.ping import Ping, Pong

    held = [await wyoming_connection(wyoming_patient) for _ in range(3)]
    for reader, writer in held:                     # each is a live connection, kept busy
        await async_write_event(Ping().event(), writer)
        assert Pong.is_type((await next_event(reader)).type)
    reader, writer = await wyoming_connection(wyoming_patient)
    assert "your address" in await expect_wyoming_error(reader, "busy")
    assert await next_event(reader) is None
    writer.close()
    await assert_wyoming_speaks(wyoming_patient)    # another address is served meanwhile
    for _, writer in held:
        writer.close()


@pytest.mark.hardening
async def test_wyoming_bad_json_of_any_shape_is_an_error_and_the_connection_closes(wyoming_patient):
    data = b"{\"a\":" * 10_000 + b"1" + b"}" * 10_000
    for bad, said in ((b"[" * 50_000 + b"\n", ""),                  # a header nested past any parser
                      (json.dumps({"type": "ping", "data_length": len(data)}).encode() + b"\n" + data, ""),
                      (json.dumps({"type": "synthesize", "data": {"text": "Hello \ud800 world."}}).encode() + b"\n",
                       "Unicode")):
        reader, writer = await wyoming_connection(wyoming_patient)
        writer.write(bad)
        assert said in await expect_wyoming_error(reader, "bad_request")
        assert await next_event(reader) is None                       # closed, as wyoming-piper does
        writer.close()
    await assert_wyoming_speaks(wyoming_patient)


@pytest.mark.hardening
async def test_one_client_over_wyoming_and_v1_is_one_owner_to_the_fair_shares(wyoming_patient):
    from wyoming.event import async_write_event
    from wyoming.tts import Synthesize

    reader, writer = await wyoming_connection(wyoming_patient, "127.0.0.1")
    await async_write_event(Synthesize(text=LONG).event(), writer)
    async with connect_client(wyoming_patient) as c:
        await c.send({"type": "start", "id": "v1", "text": LONG})
        scheduler = wyoming_patient.engine_loops[0]

        def owners() -> list[str]:
            with scheduler._cond:
                return [r.owners[0] for held in scheduler.queue._lists.values() for r in held]
        await wait_until(lambda: len(owners()) == 2)
        assert owners() == ["address:127.0.0.1"] * 2
        await c.send({"type": "cancel", "id": "v1"})
    writer.close()
