"""Voice-agent features: text streamed in, flush, stream time-out, barge-in mid-segment, segment
timestamps, telephony formats, the Python client and the `say` / `bench` commands."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import wave

import numpy as np
import pytest

from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, wait_until
from vox_ws import wire
from vox_ws.audio import bytes_to_pcm, mulaw_decode, mulaw_encode
from vox_ws.clients import v1 as vc
from vox_ws.engines.piper import PiperEngine
from vox_ws.engines.voxcpm.engine import VoxCPMEngine
from vox_ws.text import StreamSegmenter

REPLY = ("Sure, I can help with that. Your order shipped yesterday, and it should arrive on Thursday. "
         "Is there anything else I can do for you today")


def words(text):
    return [w + " " for w in text.split(" ")]


# ------------------------------------------------------------------ segmenting


def test_stream_segmenter_never_splits_words_and_cuts_early_for_first_audio():
    seg = StreamSegmenter()
    out = []
    for w in words(REPLY):
        out += seg.push(w)
    out += seg.flush_all()
    assert out[0] == "Sure, I can help with that."
    assert " ".join(out).split() == REPLY.split()
    seg = StreamSegmenter()
    assert seg.push("Let me look that up for you, ") == ["Let me look that up for you,"]
    seg = StreamSegmenter()
    assert seg.push("3.") == [] and seg.push("14 is pi. ") == ["3.14 is pi."]
    seg = StreamSegmenter()
    assert seg.push("你好，世界。今天") == ["你好，世界。"] and seg.flush_all() == ["今天"]
    seg = StreamSegmenter()
    assert seg.push("no boundary here yet") == [] and seg.flush_words() == ["no boundary here"]
    assert seg.buffer == "yet"


# ------------------------------------------------------------------ input streaming (Piper)


async def test_fast_producer_all_text_at_once(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "a", "stream_input": True, "format": "s16"})
        await c.send({"type": "chunk", "id": "a", "text": REPLY})
        await c.send({"type": "end", "id": "a"})
        result = await c.collect("a")
    assert_good_stream(result, 3.0)
    segments = result.end["segments"]
    assert " ".join(s["text"] for s in segments).split() == REPLY.split()
    assert segments[0]["start_s"] == 0.0
    for before, after in zip(segments, segments[1:]):
        assert before["end_s"] == after["start_s"] and before["end_s"] > before["start_s"]
    assert segments[-1]["end_s"] == pytest.approx(result.end["audio_s"], abs=0.02)


async def test_slow_producer_first_audio_before_end_and_segment_events(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "a", "stream_input": True, "segment_events": True})
        first_audio = asyncio.Event()
        events = []
        first_sentence, rest = REPLY.split(". ", 1)

        async def produce():
            for w in words(first_sentence + "."):
                await c.send({"type": "chunk", "id": "a", "text": w})
                await asyncio.sleep(0.08)          # ~12 words per second, like an LLM
            # The rest waits until audio has come: it must come while the text is still coming in.
            await asyncio.wait_for(first_audio.wait(), WAIT_TIMEOUT)
            for w in words(rest):
                await c.send({"type": "chunk", "id": "a", "text": w})
                await asyncio.sleep(0.08)
            await c.send({"type": "end", "id": "a"})

        producer = asyncio.create_task(produce())
        chunks = []
        while True:
            m = await c.recv_where(lambda m: m.get("id") == "a")
            if m["type"] == "chunk":
                chunks.append(m)
                first_audio.set()
            elif m["type"] == "segment":
                events.append(m)
            elif m["type"] in ("end", "error"):
                break
        await producer
    assert m["type"] == "end" and m["reason"] == "done"
    assert [e["index"] for e in events] == list(range(len(events))) and len(events) >= 3
    assert [{k: e[k] for k in ("text", "start_s", "end_s")} for e in events] == m["segments"]
    assert [ch["seq"] for ch in chunks] == list(range(len(chunks)))


async def test_flush_speaks_what_is_buffered_and_answers_flushed(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "a", "stream_input": True})
        await c.send({"type": "chunk", "id": "a", "text": "No punctuation in this part"})
        await c.send({"type": "flush", "id": "a"})
        flushed = await c.recv_where(lambda m: m["type"] == "flushed")
        assert flushed["id"] == "a" and flushed["audio_s"] > 0.5
        await c.send({"type": "chunk", "id": "a", "text": " and then the rest."})
        await c.send({"type": "end", "id": "a"})
        result = await c.collect("a")
    assert [s["text"] for s in result.end["segments"]] == ["No punctuation in this part", "and then the rest."]


async def test_input_pause_speaks_whole_words_after_a_short_delay(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "a", "stream_input": True, "segment_events": True})
        await c.send({"type": "chunk", "id": "a", "text": "hello there my frie"})
        event = await c.recv_where(lambda m: m["type"] == "segment", timeout=10)
        assert event["text"] == "hello there my"            # never inside a word
        await c.send({"type": "chunk", "id": "a", "text": "nd."})
        await c.send({"type": "end", "id": "a"})
        result = await c.collect("a")
    assert [s["text"] for s in result.end["segments"]] == ["hello there my", "friend."]


async def test_barge_in_mid_segment(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "a", "stream_input": True})
        await c.send({"type": "chunk", "id": "a", "text": REPLY + " " + REPLY + "."})
        await c.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "a")
        await c.send({"type": "cancel", "id": "a"})
        end = await c.recv_where(lambda m: m["type"] == "end" and m["id"] == "a")
        assert end["reason"] == "cancelled"
        assert_good_stream(await c.speak("Barge-in handled.", "next"))
        assert not [e for e in c.log[c.log.index(("end", "a")) + 1:] if e[1] == "a"]
    await wait_until(lambda: piper_server.devices.stats()["active"] == 0)


@pytest.mark.parametrize("after_chunks", [1, 6, 12])
async def test_barge_in_reports_what_was_heard(piper_server, after_chunks):
    """Cancel after a known number of chunks: `end.heard` is exactly the audio received, and
    its text split agrees with the segment timings the stream sent."""
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "a", "stream_input": True, "segment_events": True, "format": "s16"})
        await c.send({"type": "chunk", "id": "a", "text": REPLY + " " + REPLY + "."})
        await c.send({"type": "end", "id": "a"})
        rate = (await c.recv_where(lambda m: m["type"] == "start"))["sample_rate"]
        received, segments = 0.0, []
        chunks = 0
        while chunks < after_chunks:
            message = await c.recv_where(lambda m: m["id"] == "a" and m["type"] in ("chunk", "segment", "end"))
            if message["type"] == "chunk":
                chunks += 1
                received += len(message["audio"]) / 2 / rate
            elif message["type"] == "segment":
                segments.append(message)
            else:
                pytest.fail(f"the stream ended after {chunks} chunks: {message}")
        await c.send({"type": "cancel", "id": "a"})
        while True:                 # what was already on its way still arrives, then `end`
            message = await c.recv_where(lambda m: m["id"] == "a")
            if message["type"] == "chunk":
                received += len(message["audio"]) / 2 / rate
            elif message["type"] == "segment":
                segments.append(message)
            elif message["type"] == "end":
                break
    assert message["reason"] == "cancelled"
    heard = message["heard"]
    assert heard["audio_s"] == pytest.approx(received, abs=1e-3)
    assert message["audio_s"] == heard["audio_s"]
    # Whole segments: those whose audio all arrived, in order, contiguous from 0.
    for seg in heard["segments"]:
        assert seg["end_s"] <= heard["audio_s"] + 1e-3
    # No segment event for audio that was dropped at the cancel.
    assert [s["text"] for s in heard["segments"]] == [s["text"] for s in segments], (heard, segments, message)
    assert heard["text"] == " ".join(s["text"] for s in heard["segments"])
    starts = [0.0] + [s["end_s"] for s in heard["segments"]]
    partial = heard["partial"]
    if partial is not None:
        assert partial["start_s"] == pytest.approx(starts[-1], abs=1e-3)
        assert partial["sent_s"] == pytest.approx(heard["audio_s"] - partial["start_s"], abs=1e-3)
        assert partial["text"] and (REPLY + " " + REPLY).find(partial["text"].rstrip(".")) >= 0
        # The share of its audio sent: known once the segment was generated whole (`end`
        # lists every segment generated, sent or not).
        generated = [g for g in message["segments"] if g["start_s"] == partial["start_s"]]
        if generated:
            seg = generated[0]
            assert seg["text"] == partial["text"]
            assert partial["fraction"] == pytest.approx(partial["sent_s"] / (seg["end_s"] - seg["start_s"]), abs=1e-3)
        else:
            assert partial["fraction"] is None
    else:
        assert heard["audio_s"] == pytest.approx(starts[-1], abs=1e-3)


async def test_bad_input_streaming_messages(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "a", "stream_input": True})
        await c.send({"type": "chunk", "id": "a", "text": "x" * 4000})
        await c.send({"type": "chunk", "id": "a", "text": "y" * 2000})
        assert (await c.error("a"))["code"] == "too_large"
        await c.send({"type": "end", "id": "a"})
        await c.send({"type": "chunk", "id": "a", "text": "after end"})
        assert (await c.error("a"))["code"] == "bad_request"
        await c.send({"type": "cancel", "id": "a"})
        await c.collect("a")
        await c.send({"type": "start", "id": "v", "stream_input": True, "voice": "nobody"})
        assert (await c.error("v"))["code"] == "bad_request"
        assert_good_stream(await c.speak("Fine.", "ok"))


@pytest.mark.slow
async def test_incomplete_input_times_out(start_server):
    server = start_server(PiperEngine(), stream_timeout_s=0.6)
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "a", "stream_input": True})
        await c.send({"type": "chunk", "id": "a", "text": "Hello there."})
        result = await c.collect("a")
        assert result.error["code"] == "timeout" and result.error["retryable"] is True
        assert len(result.chunks) >= 1                       # what was sent was spoken first
        assert_good_stream(await c.speak("Still here.", "b"))


# ------------------------------------------------------------------ formats (deterministic lengths)


@pytest.fixture(scope="module")
def voxcpm_server(start_server, tiny_model):
    return start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=4), slots=4,
                        admin_tokens=["adm"])


@pytest.mark.parametrize("fmt", ["f32", "s16", "mulaw"])
@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
async def test_every_format_and_rate_decodes_to_the_right_length(voxcpm_server, fmt, rate):
    steps = 5
    async with connect_client(voxcpm_server) as c:
        result = await c.speak("Telephony.", "t", format=fmt, sample_rate=rate, options={"max_len": steps, "seed": 1})
    width = {"f32": 4, "s16": 2, "mulaw": 1}[fmt]
    raw = b"".join(ch["audio"] for ch in result.chunks)
    assert len(raw) % width == 0
    pcm = bytes_to_pcm(raw, fmt)
    assert abs(len(pcm) - rate * steps * 0.16) <= 2
    assert result.end["audio_s"] == pytest.approx(steps * 0.16, abs=0.001)
    assert np.sqrt(np.mean(pcm ** 2)) > 0.01


def test_mulaw_is_g711():
    assert mulaw_encode(np.array([0, 32767, -32768, 1000], np.int16)).tolist() == [0xFF, 0x80, 0x00, 0xCE]
    x = np.arange(-32768, 32767, 13, dtype=np.int16)
    error = np.abs(mulaw_decode(mulaw_encode(x)).astype(int) - x)
    assert np.all(error <= np.maximum(np.abs(x.astype(int)) / 16, 8))


async def test_segments_continue_from_the_previous_one(voxcpm_server):
    """Segment 2 is prompted with segment 1 (text and audio), so it differs from the same text
    spoken alone with the same seed; segment 1 equals its standalone rendering."""
    opts = {"seed": 9, "max_len": 6}
    async with connect_client(voxcpm_server) as c:
        await c.send({"type": "start", "id": "s", "stream_input": True, "options": opts})
        await c.send({"type": "chunk", "id": "s", "text": "First sentence here. Second one now."})
        await c.send({"type": "end", "id": "s"})
        streamed = await c.collect("s")
        first = await c.speak("First sentence here.", "f", options=opts)
        second = await c.speak("Second one now.", "g", options=opts)
    segs = streamed.end["segments"]
    assert [s["text"] for s in segs] == ["First sentence here.", "Second one now."]
    pcm = streamed.pcm()
    n = len(first.pcm())
    assert np.allclose(pcm[:n], first.pcm(), atol=1e-5)
    assert not np.allclose(pcm[n:n + len(second.pcm())], second.pcm(), atol=1e-3)


# ------------------------------------------------------------------ the Python client


async def test_every_client_method_takes_every_field_of_a_start(piper_server):
    """One request (`wire.Speech`), taken whole or by its fields, by every way to speak: the
    fields the signatures once lacked (markup, volume, phoneme times, language) reach the server."""
    from vox_ws.wire import Speech

    ssml = "<speak>Quiet <break time='300ms'/> now.</speak>"
    speech = Speech(format="s16", markup="ssml", volume=0.5, language="en", phoneme_timestamps=True,
                    word_timestamps=True, segment_events=True)
    async with vc.connect(piper_server.url) as client:
        s = await client.start_stream(ssml, speech)
        events = [m async for m in s.events()]
        assert s.started.get("ignored_options") is None
        assert {wire.Words, wire.Phonemes, wire.Segment} <= {type(m) for m in events}
        assert [w["word"] for w in s.words] == ["Quiet", "now."]
        # The same by name, on the other methods.
        loud = b"".join([c async for c in client.stream("Loud now.", format="s16", volume=2.0, speed=1.25)])
        soft = b"".join([c async for c in client.stream("Loud now.", speech, markup=None, speed=1.25)])
        assert np.abs(bytes_to_pcm(loud, "s16")).max() > np.abs(bytes_to_pcm(soft, "s16")).max()
        wav = await client.synthesize("A whole file.", speech, markup=None, sample_rate=16000)
        with wave.open(io.BytesIO(wav)) as w:
            assert w.getframerate() == 16000
        opened = await client.open_stream(speech, markup=None, language="en-US")
        await opened.send_text("Streamed in.")
        await opened.end()
        await opened.read_all()
        assert opened.ended["reason"] == "done" and opened.words
        with pytest.raises(TypeError, match="volumes"):
            await client.start_stream("x", volumes=2)


async def test_client_stream_synthesize_and_input_streaming(piper_server):
    async with vc.connect(piper_server.url) as client:
        assert client.hello.engine == "piper"
        chunks = [c async for c in client.stream("Hello from the client.", format="s16", sample_rate=16000)]
        assert sum(len(c) for c in chunks) / 2 / 16000 > 0.5
        wav = await client.synthesize("A whole file.", sample_rate=24000)
        with wave.open(io.BytesIO(wav)) as w:
            assert w.getframerate() == 24000 and w.getnframes() > 12000
        s = await client.open_stream(format="mulaw", sample_rate=8000, segment_events=True)
        await s.send_text("Streaming in, ")
        await s.send_text("word by word")
        flushed = await s.flush()
        assert flushed["type"] == "flushed"
        await s.send_text(". The end.")
        await s.end()
        audio = await s.read_all()
        assert s.ended["reason"] == "done" and len(s.segments) == len(s.ended["segments"]) >= 2
        assert len(audio) / 8000 == pytest.approx(s.ended["audio_s"], abs=0.01)
        # Two streams at once on one connection, and leaving a loop early cancels.
        async for _ in client.stream(REPLY):
            break
        s2 = await client.open_stream()
        await s2.send_text(REPLY + ".")
        async for _ in s2:
            await s2.cancel()
            break
        rest = [c async for c in s2]
        assert s2.ended["reason"] == "cancelled" and isinstance(rest, list)
        await client.close()
        assert client.ws.close_code == 1000
        with pytest.raises(vc.VoxError):
            await client.synthesize("After close.")


async def test_client_codecs_packets_and_speed(piper_server):
    import av

    async with vc.connect(piper_server.url) as client:
        mp3 = b"".join([c async for c in client.stream("A file in pieces.", format="mp3")])
        decoded = [f for f in av.open(io.BytesIO(mp3)).decode(audio=0)]
        assert sum(f.samples for f in decoded) > 10_000
        s = await client.open_stream(format="opus_packets", speed=1.5)
        await s.send_text("Packets for a browser, a little faster.")
        await s.end()
        packets = [p async for p in s]
        assert s.description[:8] == b"OpusHead" and len(packets) == round(s.ended["audio_s"] / 0.02)
        wav = await client.synthesize("Slower now.", speed=0.5)
        with wave.open(io.BytesIO(wav)) as w:
            assert w.getnframes() > 0


async def test_client_typed_exceptions(piper_server):
    async with vc.connect(piper_server.url) as client:
        with pytest.raises(vc.TooLarge) as info:
            async for _ in client.stream("x" * 6000):
                pass
        assert info.value.code == "too_large" and not info.value.retryable
        with pytest.raises(vc.BadRequest):
            await client.synthesize("hi", voice="nobody")
        with pytest.raises(vc.Unsupported):
            await client.register_voice(b"RIFF....")
        with pytest.raises(vc.Unauthorized):
            await client.lora("load", "x")
        assert issubclass(vc.Busy, vc.VoxError) and vc.Busy.code == "busy"
        assert {cls.code for cls in vc.ERRORS.values()} >= {"busy", "not_ready", "slow_consumer", "timeout"}
        chunks = [c async for c in client.stream("Still usable.")]
        assert chunks


async def test_client_voices_and_lora_against_voxcpm(voxcpm_server):
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(np.arange(16000) / 10)).astype(np.float32), 16000, format="WAV")
    async with vc.connect(voxcpm_server.url) as client:
        voice = await client.register_voice(buf.getvalue(), transcript="a test voice")
        audio = b"".join([c async for c in client.stream("Cloned.", voice=voice, options={"max_len": 2})])
        assert len(audio) == 2 * 7680 * 4
        assert await client.delete_voice(voice) is True
        with pytest.raises(vc.BadRequest):
            await client.synthesize("Gone.", voice=voice)
    async with vc.connect(voxcpm_server.url, token="adm") as admin:
        with pytest.raises(vc.Unsupported):            # admin, but this server has no LoRA configured
            await admin.lora("load", "x")


# ------------------------------------------------------------------ commands


def test_say_writes_a_valid_wav(piper_server, tmp_path):
    out = tmp_path / "hello.wav"
    result = subprocess.run([sys.executable, "-m", "vox_ws", "say", "Hello from the command line.", "-o", str(out),
                             "--url", piper_server.url, "--sample-rate", "16000"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with wave.open(str(out)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        frames = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert len(frames) > 16000 and np.abs(frames).max() > 1000
    ogg = tmp_path / "hello.ogg"
    result = subprocess.run([sys.executable, "-m", "vox_ws", "say", "Hello, compressed and quick.", "-o", str(ogg),
                             "--url", piper_server.url, "--format", "opus", "--speed", "1.5"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import av

    with av.open(str(ogg)) as container:
        assert container.streams.audio[0].codec_context.name == "opus"
        assert sum(frame.samples for frame in container.decode(audio=0)) > 24000
    bad = subprocess.run([sys.executable, "-m", "vox_ws", "say", "Nobody speaks.", "--voice", "nobody", "-o", str(out),
                          "--url", piper_server.url], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "bad_request" in bad.stderr and "'nobody'" in bad.stderr


@pytest.mark.slow
def test_bench_reports_table_json_and_chart(piper_server, tmp_path):
    result = subprocess.run([sys.executable, "-m", "vox_ws", "bench", "--url", piper_server.url, "--concurrency",
                             "1,2", "--duration", "3", "--stream-input", "--json", str(tmp_path / "b.json"),
                             "--chart", str(tmp_path / "b.png")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert level["streams"] >= 1 and level["first_audio_ms"]["p50"] > 0 and not level["errors"]
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "first p50" in result.stdout
    refused = subprocess.run([sys.executable, "-m", "vox_ws", "bench", "--url", "ws://192.0.2.1:1/v1/stream"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "loopback" in refused.stderr
