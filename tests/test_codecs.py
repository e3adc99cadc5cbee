"""Compressed audio and speed: protocol v1 streams in every format decode (with FFmpeg, through
PyAV) to the duration the server reports; the tempo filter keeps the voice's pitch."""

from __future__ import annotations

import hashlib
import io

import av
import httpx
import numpy as np
import pytest
import soundfile
import soxr

from conftest import HostedEngine, connect_client, wait_until
from helpers import LONG, SENTENCE, decode_file, flac_streaminfo, service_on
from vox_ws.codecs import CODECS, OutputPipeline
from vox_ws.engines.piper import PiperEngine

PITCH_TEXT = ("The quick brown fox jumps over the lazy dog, and then it rests a while. "
              "A calm voice reads the morning news, slowly and clearly, to anyone who listens.")
TEXT = "Compressed audio, streamed as it is spoken. Every chunk adds to one file."


def with_rewrites(data: bytes, rewrites: list) -> bytes:
    """A stream's file with its `end.rewrites` written over it, as a client saving it does."""
    patched = bytearray(data)
    for offset, piece in rewrites:
        patched[offset:offset + len(piece)] = piece
    return bytes(patched)


def decode_packets(packets: list[bytes], description: bytes, rate: int) -> np.ndarray:
    """Raw Opus packets, as WebCodecs' AudioDecoder gets them, through FFmpeg's decoder."""
    decoder = av.CodecContext.create("opus", "r")
    decoder.extradata = description
    decoder.sample_rate = rate
    decoder.layout = "mono"
    out = []
    for data in packets:
        for frame in decoder.decode(av.Packet(data)):
            out.append(frame.to_ndarray().reshape(-1))
    return np.concatenate(out)


def pitch_hz(pcm: np.ndarray, rate: int) -> float:
    """Median F0 of the voiced 40 ms frames, every 10 ms (autocorrelation, 70-400 Hz)."""
    size, hop = int(0.04 * rate), int(0.01 * rate)
    lo, hi = int(rate / 400), int(rate / 70)
    loud = np.sqrt(np.mean(np.square(pcm))) * 0.5
    found = []
    for start in range(0, len(pcm) - size, hop):
        frame = pcm[start:start + size] - pcm[start:start + size].mean()
        if np.sqrt(np.mean(np.square(frame))) < loud:
            continue
        corr = np.correlate(frame, frame, "full")[size - 1:]
        lag = lo + int(np.argmax(corr[lo:hi]))
        if corr[lag] > 0.5 * corr[0]:
            found.append(rate / lag)
    return float(np.median(found))


@pytest.mark.parametrize("fmt", ["opus", "mp3", "aac", "flac", "wav"])
@pytest.mark.parametrize("rate", [None, 48_000, 16_000])
async def test_v1_chunks_concatenate_to_one_file_of_the_reported_duration(piper_server, fmt, rate):
    fields = {"format": fmt} if rate is None else {"format": fmt, "sample_rate": rate}
    async with connect_client(piper_server) as c:
        assert fmt in c.hello["formats"]
        result = await c.speak(TEXT, **fields)
    assert result.error is None, result.error
    expected_rate = rate or CODECS[fmt].default_rate(piper_server.engine.sample_rate)
    assert result.start["sample_rate"] == expected_rate and result.start["format"] == fmt
    data = b"".join(chunk["audio"] for chunk in result.chunks)
    assert len(result.chunks) >= 2 and all(chunk["audio"] for chunk in result.chunks)
    assert [chunk["seq"] for chunk in result.chunks] == list(range(len(result.chunks)))
    pcm, decoded_rate = decode_file(data)
    assert pcm.size / decoded_rate == pytest.approx(result.end["audio_s"], abs=0.0011)
    assert result.end["chunks"] == len(result.chunks)
    assert np.sqrt(np.mean(np.square(pcm))) > 0.01
    metrics = httpx.get(piper_server.http + "/metrics").text
    assert f'voxws_audio_bytes_total{{format="{fmt}"}}' in metrics
    # The first chunk alone is a file a player can start on.
    first, _ = decode_file(result.chunks[0]["audio"]) if fmt != "opus" else decode_file(b"".join(
        c["audio"] for c in result.chunks[:2]))
    assert first.size > 0


@pytest.mark.parametrize("fmt", ["flac", "wav"])
async def test_v1_end_rewrites_give_a_file_soundfile_reads_with_its_length(piper_server, fmt):
    """A streamed FLAC's STREAMINFO goes before its length is known: total samples 0, and
    soundfile.read failed (`ValueError: array is too big`). The muxer now writes the true
    STREAMINFO (and WAV its sizes) at the end, and `end.rewrites` carry it: written over the
    saved stream, soundfile reads every sample, and the FLAC's MD5 is its samples'."""
    async with connect_client(piper_server) as c:
        result = await c.speak(TEXT, format=fmt)
    assert result.error is None, result.error
    streamed = b"".join(chunk["audio"] for chunk in result.chunks)
    whole = with_rewrites(streamed, result.end["rewrites"])
    assert len(whole) == len(streamed)
    pcm, rate = soundfile.read(io.BytesIO(whole), dtype="int16")
    decoded, _ = decode_file(whole)
    assert len(pcm) == decoded.size and len(pcm) / rate == pytest.approx(result.end["audio_s"], abs=0.0011)
    if fmt == "flac":
        assert flac_streaminfo(streamed) == (0, bytes(16))         # as streamed: open-ended
        assert flac_streaminfo(whole) == (len(pcm), hashlib.md5(pcm.astype("<i2").tobytes()).digest())
        with pytest.raises(ValueError, match="too big"):           # what soundfile makes of it (libsndfile)
            soundfile.read(io.BytesIO(streamed))


@pytest.mark.parametrize("rate", [48_000, 24_000])
async def test_v1_opus_packets_for_webcodecs(piper_server, rate):
    async with connect_client(piper_server) as c:
        result = await c.speak(TEXT, format="opus_packets", sample_rate=rate)
    assert result.error is None, result.error
    first = result.chunks[0]
    assert first["description"][:8] == b"OpusHead" and first["pre_skip"] > 0
    assert all("description" not in chunk for chunk in result.chunks[1:])
    packets = [p for chunk in result.chunks for p in chunk["packets"]]
    durations = [d for chunk in result.chunks for d in chunk["durations_us"]]
    assert len(packets) == len(durations) and all(d == 20_000 for d in durations)
    assert sum(durations) / 1e6 == pytest.approx(result.end["audio_s"], abs=1e-6)
    pcm = decode_packets(packets, first["description"], rate)
    # FFmpeg's decoder (at 48 kHz) drops the pre-skip the description names; the packets' own
    # durations, which `audio_s` sums, include it.
    assert pcm.size == round(result.end["audio_s"] * 48_000) - first["pre_skip"]
    assert np.sqrt(np.mean(np.square(pcm))) > 0.01


async def test_v1_rates_a_codec_cannot_take_are_refused(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "x", "text": "Hi.", "format": "opus", "sample_rate": 22050})
        err = await c.error("x")
        assert err["code"] == "bad_request" and "22050" in err["message"]
        ok = await c.speak("Still serving.", "ok", format="mp3")
        assert ok.end["reason"] == "done" and decode_file(b"".join(m["audio"] for m in ok.chunks))[0].size > 0


async def test_v1_cancel_mid_stream_in_a_codec(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "a", "text": TEXT * 4, "format": "mp3"})
        await c.recv_where(lambda m: m["type"] == "chunk")
        await c.send({"type": "cancel", "id": "a"})
        end = await c.recv_where(lambda m: m["type"] == "end")
        assert end["reason"] == "cancelled"
        after = await c.speak("Next.", "b", format="opus")
        assert after.end["reason"] == "done" and decode_file(b"".join(m["audio"] for m in after.chunks))[0].size > 0


@pytest.fixture(scope="module")
def piper_voice(piper_server) -> tuple[np.ndarray, int]:
    """One real Piper utterance (float32 at the engine's rate)."""
    import asyncio

    async def speak():
        async with connect_client(piper_server) as c:
            return await c.speak(PITCH_TEXT)

    result = asyncio.run(speak())
    return result.pcm(), result.start["sample_rate"]


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_changes_duration_not_pitch(piper_voice, speed):
    pcm, rate = piper_voice
    pipeline = OutputPipeline("f32", rate, speed)
    step = int(0.16 * rate)                        # chunk by chunk, as a stream delivers it
    pieces = [pipeline.encode(pcm[i:i + step]) for i in range(0, len(pcm), step)] + [pipeline.finish()]
    out = np.frombuffer(b"".join(piece.data for piece in pieces), "<f4")
    assert out.size / pcm.size == pytest.approx(1 / speed, rel=0.05)
    assert pipeline.samples == out.size
    # The estimate wanders some 10 % with the frames it sees (intonation); a change of pitch by
    # the speed (what resampling alone would do) moves it by 100 % or 50 %.
    assert pitch_hz(out, rate) == pytest.approx(pitch_hz(pcm, rate), rel=0.15)
    shifted = soxr.resample(pcm, rate * 2, rate)
    assert pitch_hz(shifted, rate) / pitch_hz(pcm, rate) == pytest.approx(2.0, rel=0.2)
    # No clicks at chunk joins: no sample-to-sample jump larger than the original's largest.
    assert np.abs(np.diff(out)).max() <= np.abs(np.diff(pcm)).max() * 1.2


@pytest.mark.hardening
def test_a_closed_pipeline_frees_its_tempo_graph_at_once_and_gave_it_no_threads():
    """A stream's tempo filter (FFmpeg's atempo) is freed as its pipeline closes, not when the
    garbage collector gets to it: PyAV 18 keeps a graph and its filters in a reference cycle.
    And it runs on its caller's thread: FFmpeg gave each graph a pool of a thread per core,
    which atempo never uses (two idle threads a stream here, until the collector ran)."""
    import gc
    import os
    import threading

    import av.filter

    def graphs() -> int:
        return sum(isinstance(o, av.filter.Graph) for o in gc.get_objects())

    def threads() -> int:
        """Native threads of this process that are not Python's (FFmpeg's, here)."""
        python = {str(t.native_id) for t in threading.enumerate()}
        return len(set(os.listdir("/proc/self/task")) - python)

    gc.collect()
    gc.disable()                        # what is freed now is freed by its owner, not by the collector
    try:
        before = graphs(), threads()
        pipeline = OutputPipeline("f32", 24_000, 1.5)       # raw PCM: the tempo graph is its only one
        tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(48_000) / 24_000)).astype(np.float32)
        assert sum(pipeline.encode(tone[i:i + 3840]).samples for i in range(0, tone.size, 3840)) > 0
        assert graphs() == before[0] + 1 and threads() == before[1]
        pipeline.close()
        assert (graphs(), threads()) == before
    finally:
        gc.enable()


async def test_speed_end_to_end_on_piper_keeps_the_pitch(piper_server, piper_voice):
    plain, rate = piper_voice
    async with connect_client(piper_server) as c:
        fast = await c.speak(PITCH_TEXT, speed=2.0, format="f32")
    assert fast.error is None
    out = fast.pcm()
    assert fast.end["audio_s"] == pytest.approx(out.size / rate, abs=1e-3)
    # Piper's durations vary a little between runs; the tempo is checked exactly above.
    assert out.size / plain.size == pytest.approx(0.5, rel=0.15)
    assert pitch_hz(out, rate) == pytest.approx(pitch_hz(plain, rate), rel=0.15)


@pytest.mark.hardening
async def test_cancelled_codec_streams_free_their_ffmpeg_threads_without_the_garbage_collector():
    import gc
    import os
    import threading

    from vox_ws.service import Audio, AudioOutput, StreamRequest

    def threads() -> int:
        """Native threads of this process that are not Python's (FFmpeg's, here)."""
        python = {str(t.native_id) for t in threading.enumerate()}
        return len(set(os.listdir("/proc/self/task")) - python)

    hosted = HostedEngine(PiperEngine(), slots=4)
    service = await service_on(hosted.proxy)
    try:
        warm = service.open_stream(StreamRequest(SENTENCE, output=AudioOutput("mp3", speed=1.5)))
        async for _ in warm:
            pass
        gc.collect()
        gc.disable()                    # what is freed now is freed by its owner, not by the collector
        try:
            before = threads()
            for n in range(12):
                output = AudioOutput(("mp3", "opus", "aac")[n % 3], speed=1.5)
                stream = service.open_stream(StreamRequest(LONG, output=output))
                async for event in stream:
                    if isinstance(event, Audio):
                        break
                if n % 2:
                    stream.cancel()
                    async for _ in stream:
                        pass
                else:
                    stream.close()      # the consumer went away
            await wait_until(lambda: threads() <= before)
        finally:
            gc.enable()
    finally:                            # the engine's worker stopped, whatever the test's end
        hosted.stop()
        await service.close()
