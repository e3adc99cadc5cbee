"""The stream service driven directly, with no socket: the real Piper voice and the tiny VoxCPM2."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from conftest import HostedEngine, wait_until
from helpers import LONG, SENTENCE, audio_of, drain, service_on, tone_wav
from vox_ws.engine import EndReason, ErrorKind, Refused
from vox_ws.engine_process.launch import InProcess
from vox_ws.engine_process.proxy import EngineProxy
from vox_ws.engines.piper import PiperEngine
from vox_ws.service import Audio, AudioOutput, Ended, Failed, Flushed, Segment, StreamRequest


@pytest.fixture(scope="module")
def piper_scheduler():
    hosted = HostedEngine(PiperEngine())
    yield hosted.proxy
    hosted.stop()


# ------------------------------------------------------------------ Piper


async def test_one_shot_stream_yields_contiguous_audio_then_ended(piper_scheduler):
    service = await service_on(piper_scheduler)
    stream = service.open_stream(StreamRequest(SENTENCE, output=AudioOutput("s16", 16000)))
    assert stream.sample_rate == 16000 and stream.format == "s16" and stream.ignored_options == []
    events = await drain(stream)
    chunks = [e for e in events if isinstance(e, Audio)]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    # Piper speaks the sentence (2.8 s) in one step; no chunk carries much more than a second.
    assert len(chunks) >= 3 and all(c.seconds <= 1.05 for c in chunks)   # + the resampler's delay
    assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.DONE
    pcm = audio_of(events, "s16")
    stats = events[-1].stats
    assert stats["chunks"] == len(chunks) and abs(stats["audio_s"] - len(pcm) / 16000) < 1e-3
    assert sum(c.samples for c in chunks) == len(pcm)
    assert len(pcm) / 16000 > 1.0 and float(np.sqrt(np.mean(pcm ** 2))) > 0.01
    (segment,) = stats["segments"]
    # The segment ends where its generated audio ends; the resampler's tail follows it.
    assert segment["text"] == SENTENCE and segment["start_s"] == 0.0
    assert 0 <= stats["audio_s"] - segment["end_s"] < 0.05
    assert service.open_streams == 0
    await service.close()


async def test_text_streamed_in_gives_segments_and_flush_marks(piper_scheduler):
    service = await service_on(piper_scheduler)
    stream = service.open_stream(StreamRequest(input_streaming=True, output=AudioOutput("f32")))
    stream.send_text("Hello there, my friend. ")
    stream.send_text("This part waits for a flush")
    stream.flush()
    stream.send_text(" and this is the end.")
    stream.end_input()
    events = await drain(stream)
    kinds = [type(e).__name__ for e in events]
    segments = [e for e in events if isinstance(e, Segment)]
    assert [s.text for s in segments] == ["Hello there, my friend.", "This part waits for a flush",
                                          "and this is the end."]
    assert all(a.end_s == b.start_s for a, b in zip(segments, segments[1:]))
    flushed = [e for e in events if isinstance(e, Flushed)]
    assert len(flushed) == 1 and abs(flushed[0].audio_s - segments[1].end_s) < 1e-3
    # The flush mark comes after the audio of the flushed text, before the next segment's.
    assert kinds.index("Flushed") > [i for i, e in enumerate(events) if e is segments[1]][0]
    assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.DONE
    await service.close()


async def test_text_from_an_async_iterator(piper_scheduler):
    service = await service_on(piper_scheduler)

    async def llm():
        for word in "Streaming words in, one at a time, as a model writes them.".split():
            yield word + " "
            await asyncio.sleep(0.01)

    events = await drain(service.open_stream(StreamRequest(llm())))
    assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.DONE
    assert " ".join(s["text"] for s in events[-1].stats["segments"]).split() == \
        "Streaming words in, one at a time, as a model writes them.".split()
    await service.close()


async def test_cancel_drops_untaken_audio_and_frees_the_slot(piper_scheduler):
    service = await service_on(piper_scheduler)
    stream = service.open_stream(StreamRequest(LONG))
    first = await stream.__anext__()
    assert isinstance(first, Audio)
    await wait_until(lambda: stream.chunks >= 2)
    stream.cancel()
    rest = await drain(stream)
    assert len(rest) == 1 and isinstance(rest[0], Ended) and rest[0].reason == EndReason.CANCELLED
    assert rest[0].stats["chunks"] == 1 and abs(rest[0].stats["audio_s"] - first.seconds) < 1e-3
    await wait_until(lambda: piper_scheduler.stats()["active"] == 0)
    await service.close()


async def test_leaving_the_iterator_cancels(piper_scheduler):
    service = await service_on(piper_scheduler)
    stream = service.open_stream(StreamRequest(LONG))
    async for event in stream:
        assert isinstance(event, Audio)
        break
    await stream.aclose()
    assert stream.done
    await wait_until(lambda: piper_scheduler.stats()["active"] == 0)
    await service.close()


async def test_a_consumer_that_stops_taking_pauses_generation_then_fails_slow(piper_scheduler):
    service = await service_on(piper_scheduler, max_buffered_audio_s=1.0, write_stall_timeout_s=1.0)
    stream = service.open_stream(StreamRequest(LONG * 2))
    await wait_until(lambda: stream.chunks >= 1)
    engine_loop = piper_scheduler.launcher.host.loop            # the engine's own, in its process
    steps = engine_loop.steps_total
    await asyncio.sleep(0.5)
    # Paused: at most the step that was running when the backlog filled.
    assert engine_loop.steps_total <= steps + 1
    # Nothing is taken: after write_stall_timeout_s the stream fails, before anything is read.
    await wait_until(lambda: stream.done)
    events = await drain(stream)
    assert isinstance(events[-1], Failed) and events[-1].kind == ErrorKind.SLOW_CONSUMER
    assert events[-1].kind.retryable
    await wait_until(lambda: piper_scheduler.stats()["active"] == 0)
    await service.close()


async def test_input_that_stops_coming_times_out(piper_scheduler):
    service = await service_on(piper_scheduler, stream_timeout_s=0.5)
    stream = service.open_stream(StreamRequest("Just this much. ", input_streaming=True))
    events = await drain(stream, timeout=10)
    assert isinstance(events[-1], Failed) and events[-1].kind == ErrorKind.TIMEOUT
    assert [e.text for e in events if isinstance(e, Segment)] == ["Just this much."]
    await service.close()


async def test_refusals_are_typed(piper_scheduler):
    service = await service_on(piper_scheduler, max_text_chars=100)
    cases = [
        (lambda: service.open_stream(StreamRequest("Hi.", voice="nobody")), ErrorKind.INVALID),
        (lambda: service.open_stream(StreamRequest("x" * 101)), ErrorKind.TOO_LARGE),
        (lambda: service.open_stream(StreamRequest("   ")), ErrorKind.INVALID),
        (lambda: service.open_stream(StreamRequest("Hi.")).send_text("more"), ErrorKind.INVALID),
    ]
    for attempt, kind in cases:
        with pytest.raises(Refused) as info:
            attempt()
        assert info.value.kind == kind, info.value.message
    stream = service.open_stream(StreamRequest(input_streaming=True))
    stream.end_input()
    with pytest.raises(Refused) as info:
        stream.send_text("late")
    assert info.value.kind == ErrorKind.INVALID
    with pytest.raises(Refused) as info:
        await service.voices.register(b"RIFF")
    assert info.value.kind == ErrorKind.UNSUPPORTED
    service.accepting = False
    with pytest.raises(Refused) as info:
        service.open_stream(StreamRequest("Hi."))
    assert info.value.kind == ErrorKind.GOING_AWAY and info.value.kind.retryable
    await service.close()
    await wait_until(lambda: piper_scheduler.stats()["active"] == 0)


async def test_full_queue_is_busy_and_a_loading_engine_not_ready():
    hosted = HostedEngine(PiperEngine(), slots=1, max_queue=1)
    service = await service_on(hosted.proxy)
    streams = [service.open_stream(StreamRequest(LONG)), service.open_stream(StreamRequest(LONG))]
    assert [s.queued for s in streams] == [0, 1]
    # The engine's slot queue refuses the third (in its process, where the queue is): the stream
    # opens and fails at once, saying when a place should free.
    refused = await drain(service.open_stream(StreamRequest(LONG)))
    assert [type(e) for e in refused] == [Failed] and refused[0].kind == ErrorKind.BUSY
    assert refused[0].retry_after_s is not None
    for stream in streams:
        stream.cancel()
    hosted.stop()
    await service.close()
    not_loaded = EngineProxy(InProcess(PiperEngine()), "piper")         # never started: loading
    service = await service_on(not_loaded)
    with pytest.raises(Refused) as info:
        service.open_stream(StreamRequest("Hi."))
    assert info.value.kind == ErrorKind.NOT_READY
    await service.close()


# ------------------------------------------------------------------ tiny VoxCPM2


@pytest.fixture(scope="module")
def voxcpm_scheduler(tiny_model):
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    hosted = HostedEngine(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=4))
    yield hosted.proxy
    hosted.stop()


async def test_voxcpm_streams_batched_with_options_and_cloned_voice(voxcpm_scheduler):
    service = await service_on(voxcpm_scheduler)
    registered = await service.voices.register(tone_wav(1.0), "A short reference.")
    assert registered["voice"].startswith("v_") and registered["mode"] == "both"
    a = service.open_stream(StreamRequest("Hello there.", options={"max_len": 6, "seed": 1, "cfg_value": 1.5}))
    b = service.open_stream(StreamRequest("Hello there.", voice=registered["voice"], options={"max_len": 4, "seed": 1},
                                          output=AudioOutput("s16", 24000)))
    c = service.open_stream(StreamRequest("Hello there.", options={"max_len": 6, "seed": 1, "cfg_value": 1.5}))
    events_a, events_b, events_c = await asyncio.gather(drain(a), drain(b), drain(c))
    for events, steps, rate in ((events_a, 6, 48000), (events_b, 4, 24000)):
        assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.MAX_LEN
        pcm = audio_of(events, "f32" if rate == 48000 else "s16")
        assert abs(len(pcm) - steps * 7680 * rate // 48000) <= 64
    # The same seed, text and options give the same audio (to float rounding: batch shapes differ).
    assert np.max(np.abs(audio_of(events_a, "f32") - audio_of(events_c, "f32"))) < 1e-4
    assert await service.voices.delete(registered["voice"]) is True
    with pytest.raises(Refused) as info:
        service.open_stream(StreamRequest("Hello.", voice=registered["voice"]))
    assert info.value.kind == ErrorKind.INVALID
    await service.close()


async def test_voxcpm_refusals_come_from_the_engine_in_its_own_words(voxcpm_scheduler):
    service = await service_on(voxcpm_scheduler, max_voice_audio_s=2.0)
    # A text longer than the model's context is no refusal: the engine cuts it where it fits.
    long = service.open_stream(StreamRequest("word " * 900, options={"max_len": 2}))
    events = [event async for event in long]
    assert isinstance(events[-1], Ended) and len(events[-1].stats["segments"]) > 1
    with pytest.raises(Refused) as info:
        await service.voices.register(tone_wav(3.0))
    assert info.value.kind == ErrorKind.TOO_LARGE
    with pytest.raises(Refused) as info:
        await service.voices.register(b"not audio at all")
    assert info.value.kind == ErrorKind.INVALID
    with pytest.raises(Refused) as info:
        await service.voices.register(tone_wav(1.0), mode="continuation")
    assert info.value.kind == ErrorKind.INVALID
    with pytest.raises(Refused) as info:
        await service.loras.load("x")
    assert info.value.kind == ErrorKind.UNSUPPORTED
    await service.close()


async def test_voxcpm_input_streaming_continues_each_segment_from_the_last(voxcpm_scheduler):
    service = await service_on(voxcpm_scheduler)
    stream = service.open_stream(StreamRequest(input_streaming=True, options={"max_len": 3, "seed": 7}))
    stream.send_text("First sentence here. ")
    stream.send_text("Second one follows. ")
    stream.end_input()
    events = await drain(stream)
    segments = [e for e in events if isinstance(e, Segment)]
    assert len(segments) == 2 and segments[1].start_s == segments[0].end_s > 0
    assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.MAX_LEN
    await service.close()
