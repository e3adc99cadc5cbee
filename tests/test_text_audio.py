"""Text segmentation and audio encoding."""

import io
import wave

import numpy as np
import pytest

from vox_ws.audio import StreamEncoder, bytes_to_pcm, pcm_to_bytes, wav_bytes
from vox_ws.text import StreamSegmenter, base_language, segment, split_sentences


def test_segments_keep_every_word_and_split_at_punctuation():
    text = ("Hello there, this is a test of a longer sentence, with many clauses, that keeps going for "
            "quite a while before it ends. Short one! And another?")
    parts = segment(text)
    assert " ".join(parts).split() == text.split()
    assert parts[0].endswith(",") and len(parts[0]) <= 60
    assert parts[-2:] == ["Short one!", "And another?"]


def test_chinese_punctuation_splits():
    assert segment("你好，世界。这是一个测试！好的") == ["你好，世界。", "这是一个测试！", "好的"]


def test_never_splits_inside_a_word():
    text = " ".join(["word"] * 200)
    parts = segment(text)
    assert all(len(p) <= 240 for p in parts)
    assert " ".join(parts).split() == text.split()


@pytest.mark.parametrize("fmt", ["f32", "s16"])
def test_format_round_trip(fmt):
    pcm = np.sin(np.linspace(0, 20, 1000)).astype(np.float32) * 0.5
    back = bytes_to_pcm(pcm_to_bytes(pcm, fmt), fmt)
    assert np.allclose(back, pcm, atol=1e-4)


@pytest.mark.parametrize("rate", [8000, 16000, 24000, 44100, 48000])
def test_resampler_keeps_length_and_has_no_seams(rate):
    sr = 22050
    t = np.arange(sr) / sr
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    enc = StreamEncoder(sr, rate, "f32")
    pieces = [enc.encode(c) for c in np.array_split(tone, 7)] + [enc.flush()]
    out = bytes_to_pcm(b"".join(pieces), "f32")
    assert abs(len(out) - rate) <= 2
    whole = bytes_to_pcm(StreamEncoder(sr, rate, "f32").encode(tone) + b"", "f32")
    # Chunked and one-shot resampling agree sample for sample where both have output.
    n = min(len(whole), len(out))
    assert np.allclose(out[:n], whole[:n], atol=1e-5)


def test_wav_bytes_is_a_valid_wav():
    data = wav_bytes(np.zeros(1600, np.float32), 16000)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (1, 16000, 1600)


def test_segments_ramp_up_so_the_next_is_ready_before_the_last_has_played():
    text = ("Hello from the browser. This audio plays while it is being generated, one sentence after another, "
            "and the sentences after it may be longer still, since by then there is audio in hand to play.")
    parts = segment(text)
    assert " ".join(parts).split() == text.split()
    assert parts[0] == "Hello from the browser."
    for before, after in zip(parts, parts[1:]):
        assert len(after) <= max(60, 2 * len(before)), (before, after)


# Sentence ends in many scripts, and the periods that end none (abbreviations, decimals, initials).
SENTENCES = {
    None: ("Hello Dr. Smith. It costs 3.14 dollars. J. R. R. Tolkien wrote it, e.g. this one! Was it?",
           ["Hello Dr. Smith.", "It costs 3.14 dollars.", "J. R. R. Tolkien wrote it, e.g. this one!", "Was it?"]),
    "zh": ("你好。今天天气很好！我们走吧？", ["你好。", "今天天气很好！", "我们走吧？"]),
    "ja": ("こんにちは。元気ですか？はい、元気です！", ["こんにちは。", "元気ですか？", "はい、元気です！"]),
    "hi": ("नमस्ते। आप कैसे हैं? मैं ठीक हूँ।", ["नमस्ते।", "आप कैसे हैं?", "मैं ठीक हूँ।"]),
    "ar": ("مرحبا. كيف حالك؟ أنا بخير!", ["مرحبا.", "كيف حالك؟", "أنا بخير!"]),
    # Thai marks a sentence end with a space, no punctuation.
    "th": ("สวัสดีครับ วันนี้อากาศดีมาก ไปเที่ยวกันไหม", ["สวัสดีครับ", "วันนี้อากาศดีมาก", "ไปเที่ยวกันไหม"]),
    "de": ("Wir sehen uns um 8 Uhr bzw. später. Ja.", ["Wir sehen uns um 8 Uhr bzw. später.", "Ja."]),
}


@pytest.mark.parametrize("language", list(SENTENCES), ids=lambda lang: lang or "unsaid")
def test_sentences_end_where_the_language_ends_them(language):
    text, sentences = SENTENCES[language]
    assert split_sentences(text, language) == sentences


@pytest.mark.parametrize("language", list(SENTENCES), ids=lambda lang: lang or "unsaid")
def test_a_streamed_text_is_cut_at_the_same_ends_whatever_its_pieces(language):
    """Character by character (an LLM's tokens at their finest), every sentence is cut as soon
    as the space after it has come (CJK and the danda: the mark itself), at the same places as
    the whole text."""
    text, sentences = SENTENCES[language]
    segmenter = StreamSegmenter(first_clause_words=99, language=language)
    cut = [piece for character in text for piece in segmenter.push(character)]
    assert cut == sentences[:len(cut)] and len(cut) >= len(sentences) - 1
    assert cut + segmenter.flush_all() == sentences


def test_what_a_language_abbreviates_is_not_a_sentence_end():
    text = "Wir sehen uns um 8 Uhr bzw. später. Er kam am 3. Mai an."
    assert split_sentences(text, "de") == ["Wir sehen uns um 8 Uhr bzw. später.", "Er kam am 3. Mai an."]
    assert split_sentences(text) == ["Wir sehen uns um 8 Uhr bzw.", "später.", "Er kam am 3.", "Mai an."]


def test_a_period_waits_for_what_follows():
    segmenter = StreamSegmenter(first_clause_words=99)
    assert segmenter.push("It costs 3.") == []                            # "3." may go on: "3.14"
    assert segmenter.push("14 dollars. ") == ["It costs 3.14 dollars."]   # the space is enough
    assert segmenter.push("Then Dr. ") == [] and segmenter.push("Smith came. ") == ["Then Dr. Smith came."]


def test_languages_are_tags_of_any_region():
    assert [base_language(tag) for tag in ("en-US", "en_GB", "zh-Hant-TW", "PT", None, "")] == \
        ["en", "en", "zh", "pt", "en", "en"]
