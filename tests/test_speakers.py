"""Multi-speaker Piper voices (libritts and the like): each speaker a voice of its own
(`voice:speaker`, listed), chosen by `speaker` over v1 and OpenAI, by Wyoming's `voice.speaker`,
and listed under its voice in Wyoming's `describe`. The voice is the bundled one made to take a
speaker id, each speaker at a gain of its own (`vox_ws.testing.piper_speakers`)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeVoice

from conftest import connect_client
from vox_ws.engines.piper import PiperEngine
from vox_ws.engines.piper_voices import voice_set
from vox_ws.testing.piper_speakers import multi_speaker_voice

TRIO = "en_US-trio-medium"
TEXT = "Hello there, this is one of three speakers."


def rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2)))


async def wyoming_level(trio, speaker: str) -> float:
    """The loudness of TEXT spoken over Wyoming by TRIO's `speaker`."""
    async with AsyncTcpClient("127.0.0.1", trio.server.wyoming.port) as c:
        await c.write_event(Synthesize(text=TEXT, voice=SynthesizeVoice(name=TRIO, speaker=speaker)).event())
        assert AudioStart.is_type((await c.read_event()).type)
        pieces = []
        while not AudioStop.is_type((event := await c.read_event()).type):
            pieces.append(np.frombuffer(AudioChunk.from_event(event).audio, "<i2"))
        return rms(np.concatenate(pieces) / 32768)


@pytest.fixture(scope="module")
def trio(start_server, tmp_path_factory):
    model = multi_speaker_voice(tmp_path_factory.mktemp("speakers"), TRIO)
    return start_server(PiperEngine(voices=voice_set([str(model)])), wyoming="tcp://127.0.0.1:0")


async def test_each_speaker_is_a_voice_chosen_by_speaker_over_v1_and_openai(trio):
    listed = [v["id"] for v in httpx.get(trio.http + "/v1/voices").json()["voices"] if v["kind"] == "builtin"]
    assert listed == ["joe", TRIO, f"{TRIO}:loud", f"{TRIO}:mid", f"{TRIO}:soft"]
    async with connect_client(trio) as c:
        loud = await c.speak(TEXT, "a", voice=TRIO, speaker="loud", options={"noise_scale": 0.0, "noise_w_scale": 0.0})
        soft = await c.speak(TEXT, "b", voice=TRIO, speaker="soft", options={"noise_scale": 0.0, "noise_w_scale": 0.0})
        mid = await c.speak(TEXT, "c", voice=f"{TRIO}:mid", options={"noise_scale": 0.0, "noise_w_scale": 0.0})
        unknown = await c.speak(TEXT, "d", voice=TRIO, speaker="nobody")
    assert 3.5 < rms(loud.pcm()) / rms(soft.pcm()) < 4.5 and 1.7 < rms(loud.pcm()) / rms(mid.pcm()) < 2.3
    assert unknown.error["code"] == "bad_request" and "nobody" in unknown.error["message"]
    body = {"input": TEXT, "voice": TRIO, "speaker": "soft", "response_format": "pcm", "noise_scale": 0.0,
            "noise_w_scale": 0.0}
    over_openai = httpx.post(trio.http + "/v1/audio/speech", json=body, timeout=60)
    assert over_openai.status_code == 200
    assert rms(np.frombuffer(over_openai.content, "<i2") / 32768) == pytest.approx(rms(soft.pcm()), rel=0.15)


async def test_home_assistant_sees_the_speakers_and_picks_one(trio):
    client = AsyncTcpClient("127.0.0.1", trio.server.wyoming.port)
    async with client:
        await client.write_event(Describe().event())
        voices = {v.name: v for v in Info.from_event(await client.read_event()).tts[0].voices}
    assert f"{TRIO}:loud" not in voices                                # one entry, its speakers with it
    assert [s.name for s in voices[TRIO].speakers] == ["loud", "mid", "soft"] and voices["joe"].speakers is None

    assert 2.5 < await wyoming_level(trio, "loud") / await wyoming_level(trio, "soft") < 6


async def test_a_speaker_by_number_as_piper_and_wyoming_piper_take_it(trio):
    """Piper (`--speaker 1`) and wyoming-piper (`voice.speaker: "1"`) take a speaker by its
    number; vox-ws refused "1" as an unknown voice. The number is the speaker's id in the voice's
    `speaker_id_map` (0 loud, 1 mid, 2 soft), over v1, OpenAI (a string or a JSON number) and
    Wyoming; one past the last is refused naming the voice's speakers, and the server goes on."""
    still = {"noise_scale": 0.0, "noise_w_scale": 0.0}
    async with connect_client(trio) as c:
        by_name = await c.speak(TEXT, "a", voice=TRIO, speaker="soft", options=still)
        by_number = await c.speak(TEXT, "b", voice=TRIO, speaker="2", options=still)
        in_the_name = await c.speak(TEXT, "c", voice=f"{TRIO}:0", options=still)
        past_the_last = await c.speak(TEXT, "d", voice=TRIO, speaker="3")
        of_a_single_speaker = await c.speak(TEXT, "e", voice="joe", speaker="1")
        after = await c.speak(TEXT, "f", voice=TRIO, speaker="1", options=still)
    assert rms(by_number.pcm()) == pytest.approx(rms(by_name.pcm()), rel=0.02)
    assert 3.5 < rms(in_the_name.pcm()) / rms(by_number.pcm()) < 4.5           # 0 is loud
    assert past_the_last.error["code"] == "bad_request"
    said = past_the_last.error["message"]
    assert "no speaker '3'" in said and "0 loud, 1 mid, 2 soft" in said
    assert of_a_single_speaker.error["code"] == "bad_request"
    assert "one speaker" in of_a_single_speaker.error["message"]
    assert 1.7 < rms(in_the_name.pcm()) / rms(after.pcm()) < 2.3               # 1 is mid

    for speaker in ("2", 2):                               # OpenAI's door; Piper's own server sends a number
        body = {"input": TEXT, "voice": TRIO, "speaker": speaker, "response_format": "pcm", **still}
        spoken = httpx.post(trio.http + "/v1/audio/speech", json=body, timeout=60)
        assert spoken.status_code == 200, spoken.text
        spoken_rms = rms(np.frombuffer(spoken.content, "<i2") / 32768)
        assert spoken_rms == pytest.approx(rms(by_name.pcm()), rel=0.15)
    refused = httpx.post(trio.http + "/v1/audio/speech", timeout=60,
                         json={"input": TEXT, "voice": TRIO, "speaker": "9", "response_format": "pcm"})
    assert refused.status_code == 400 and "no speaker '9'" in refused.json()["error"]["message"]

    # as wyoming-piper: loud over soft
    assert 2.5 < await wyoming_level(trio, "0") / await wyoming_level(trio, "2") < 6
