"""A small SSML subset: breaks are exact silence at their place in the audio and in the timings;
substitutions and spelling; unknown markup is a typed error naming it, never read aloud; plain
text is never parsed. Over protocol v1 on Piper and over the `openai` SDK on the tiny VoxCPM2."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from conftest import assert_good_stream, bytes_to_pcm, connect_client
from helpers import FRAME_S, longest_zero_run
from vox_ws.engine import ErrorKind, Refused
from vox_ws.service.markup import MAX_BREAK_S, Pause, parse_ssml, wants_markup
from vox_ws.service.silence import MAX_SILENCE_S, SilenceBudget

# ------------------------------------------------------------------ the parser


def test_the_subset_becomes_texts_and_pauses():
    ssml = ('<speak version="1.0" xml:lang="en-US"><p><s>Hello <sub alias="World Wide Web">WWW</sub>.</s>'
            '<s>Spell <say-as interpret-as="characters">AB C</say-as> now</s></p>'
            '<break time="700ms"/><break strength="weak"/>After.<break time="1.5s"/></speak>')
    assert parse_ssml(ssml) == ["Hello World Wide Web.", "Spell A B C now", Pause(1.2), "After.", Pause(1.5)]
    assert parse_ssml("No root <break/> needed") == ["No root", Pause(0.75), "needed"]
    assert parse_ssml('<speak xmlns="http://www.w3.org/2001/10/synthesis">Namespaced.</speak>') == ["Namespaced."]


@pytest.mark.parametrize("ssml, named", [
    ("<speak><prosody rate='slow'>Hi</prosody></speak>", "<prosody>"),
    ("<speak><break time='fast'/></speak>", "'fast'"),
    ("<speak><break strength='huge'/></speak>", "'huge'"),
    ("<speak><break duration='1s'/></speak>", "'duration'"),
    ("<speak><say-as interpret-as='date'>1/2</say-as></speak>", "'date'"),
    ("<speak><sub>no alias</sub></speak>", "alias"),
    ("<speak>unclosed <s></speak>", "well-formed"),
    ('<!DOCTYPE x [<!ENTITY a "aaaa">]><speak>&a;</speak>', "entities"),
    ("<speak>" + "<s>" * 20 + "deep" + "</s>" * 20 + "</speak>", "nested"),
])
def test_markup_outside_the_subset_is_refused_naming_it(ssml, named):
    with pytest.raises(Refused) as refused:
        parse_ssml(ssml)
    assert refused.value.kind == ErrorKind.INVALID and named in refused.value.message


def test_silence_is_bounded_per_break_and_per_request():
    with pytest.raises(Refused) as one:
        parse_ssml(f'<speak>A<break time="{MAX_BREAK_S + 1:g}s"/>B</speak>')
    breaks = "".join(f'<break time="{MAX_BREAK_S:g}s"/>x' for _ in range(int(MAX_SILENCE_S / MAX_BREAK_S) + 1))
    parts = parse_ssml(f"<speak>{breaks}</speak>")
    with pytest.raises(Refused) as total:       # the request's silence in all: the stream's budget
        SilenceBudget(speed=1.0).spend(breaks_s=sum(p.seconds for p in parts if isinstance(p, Pause)))
    assert one.value.kind == total.value.kind == ErrorKind.TOO_LARGE


def test_plain_text_is_never_parsed():
    assert not wants_markup("a < b, and <speak> in the middle", None)
    assert not wants_markup("<speak>Said as it is.</speak>", "none")
    assert wants_markup("  <speak>Hi</speak>", None) and wants_markup("Hi <break/>", "ssml")
    with pytest.raises(Refused):
        wants_markup("Hi", "html")


# ------------------------------------------------------------------ end to end


async def test_a_break_is_exact_silence_at_its_place_and_shifts_what_follows(piper_server):
    ssml = '<speak>Hello there.<break time="700ms"/>How are you?</speak>'
    async with connect_client(piper_server) as c:
        result = await c.speak(ssml, "b", format="f32", word_timestamps=True)
        words = [m for m in c.log if m[0] == "words"]
        assert words
    assert_good_stream(result)
    rate = result.start["sample_rate"]
    start, length = longest_zero_run(result.pcm())
    assert abs(length / rate - 0.7) <= FRAME_S
    first, second = result.end["segments"]
    assert (first["text"], second["text"]) == ("Hello there.", "How are you?")
    assert abs(start / rate - first["end_s"]) <= FRAME_S
    assert abs(second["start_s"] - (first["end_s"] + 0.7)) <= FRAME_S
    assert result.end["usage"]["characters"] == len(ssml)


async def test_word_times_after_a_break_come_after_it(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "w", "text": 'One two.<break time="1s"/>Three <sub alias="four">4</sub>.',
                      "format": "f32", "word_timestamps": True, "markup": "ssml"})
        words, end = [], None
        while end is None:
            message = await c.recv_where(lambda m: m.get("id") == "w")
            if message["type"] == "words":
                words += message["words"]
            elif message["type"] in ("end", "error"):
                end = message
    assert end["type"] == "end", end
    assert [w["word"] for w in words] == ["One", "two.", "Three", "four."]
    first = end["segments"][0]
    assert words[1]["end_s"] <= first["end_s"] + 1e-3
    assert words[2]["start_s"] >= first["end_s"] + 1.0 - FRAME_S


async def test_unknown_markup_is_an_error_and_the_connection_serves_on(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "x", "text": "<speak>Hi <audio src='x.wav'/></speak>"})
        error = await c.error("x")
        assert error["code"] == "bad_request" and "<audio>" in error["message"]
        await c.send({"type": "start", "id": "m", "text": "Hi", "markup": "html"})
        assert (await c.error("m"))["code"] == "bad_request"
        await c.send({"type": "start", "id": "s", "stream_input": True, "markup": "ssml"})
        assert "one-shot" in (await c.error("s"))["message"]
        # Text with angle brackets, not SSML, is spoken as it is.
        assert_good_stream(await c.speak("Two < three, and <speak> comes later.", "plain"))


async def test_a_break_over_openais_api_on_the_tiny_voxcpm(tiny_voxcpm):
    import openai

    server = tiny_voxcpm
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)

    def say(text: str, **extra) -> np.ndarray:
        with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input=text, response_format="pcm",
                extra_body={"max_len": 4, "sample_rate": 16_000, **extra}) as response:
            return bytes_to_pcm(response.read(), "s16")
    pcm = await asyncio.to_thread(say, 'First.<break time="700ms"/>Second.', markup="ssml")
    start, length = longest_zero_run(pcm)
    assert abs(length / 16_000 - 0.7) <= FRAME_S and 0 < start < len(pcm) - length
    with pytest.raises(openai.BadRequestError) as refused:
        await asyncio.to_thread(say, "<speak><emphasis>Loud</emphasis></speak>")
    assert "<emphasis>" in refused.value.body["message"]
