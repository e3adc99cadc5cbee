"""True word timings for Piper: which text word each phoneme speaks, and how long each phoneme
lasts in the audio (Piper's duration predictor, exposed by the model's alignment output).

Durations: the VITS model predicts how many audio frames each phoneme id lasts; piper-tts adds
that prediction as a second output of the ONNX graph (`piper.patch_voice_with_alignment`, with
the `onnx` package). A phoneme's samples are those of its ids and the pad after it, exactly as
`PiperVoice.synthesize` aligns them; they add up to the audio's length.

Words: espeak-ng phonemizes a sentence as a whole, and its phoneme words need not be the text's
words ("of the" -> one phoneme word, "1999" -> three). Each text word is phonemized alone and
the sentence's phonemes are matched against those, letter by letter (difflib), so every phoneme
belongs to one text word; stress marks, spaces and punctuation belong to none. The times are
then the model's own: the first and last sample of the word's phonemes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..text import matched_owners

NO_WORD = -1
# Phonemes that carry no sound of their own and may differ between a word alone and in context.
_MARKS = frozenset(" ˈˌ.,;:!?-'\"()")


def word_owners(words: Sequence[str], sentences: Sequence[Sequence[str]],
                phonemize: Callable[[str], list[list[str]]]) -> list[list[int]]:
    """For each phoneme of each sentence, the index of the text word it speaks, or NO_WORD."""
    if len(words) == 1:          # one word (a CJK run, a number): nothing to match
        return [[NO_WORD if ph in _MARKS else 0 for ph in sentence] for sentence in sentences]
    reference: list[str] = []
    reference_owner: list[int] = []
    for index, word in enumerate(words):
        for phoneme in (ph for sentence in phonemize(word) for ph in sentence if ph not in _MARKS):
            reference.append(phoneme)
            reference_owner.append(index)
    spoken = [(s, i) for s, sentence in enumerate(sentences) for i, ph in enumerate(sentence) if ph not in _MARKS]
    owners = [[NO_WORD] * len(sentence) for sentence in sentences]
    # Phonemes with no counterpart (espeak said more in context) go with the word before them.
    for (s, i), owner in zip(spoken, matched_owners(reference, reference_owner, [sentences[s][i] for s, i in spoken])):
        owners[s][i] = owner
    # A stress mark belongs to the phoneme after it.
    for s, sentence in enumerate(sentences):
        for i in range(len(sentence) - 2, -1, -1):
            if sentence[i] in "ˈˌ":
                owners[s][i] = owners[s][i + 1]
    return owners


def phoneme_samples(phonemes: Sequence[str], id_samples: Sequence[int], id_map: Mapping[str, Sequence[int]],
                    bos: str = "^", eos: str = "$", pad: str = "_") -> tuple[int, list[int]] | None:
    """Samples before the first phoneme (the start marker's), and each phoneme's samples (its
    ids and the pad after it, as `piper.phonemes_to_ids` lays them out); None where the ids do
    not line up (a phoneme missing from the voice's map is skipped there and here alike)."""
    pad_n = len(id_map.get(pad, ()))
    position = len(id_map[bos]) + pad_n
    lead = int(sum(id_samples[:position]))
    samples: list[int] = []
    for phoneme in phonemes:
        count = len(id_map[phoneme]) + pad_n if phoneme in id_map else 0
        samples.append(int(sum(id_samples[position:position + count])))
        position += count
    if position + len(id_map[eos]) != len(id_samples):
        return None
    return lead, samples


def phoneme_spans(phonemes: Sequence[str], lead: int, samples: Sequence[int]) -> list[tuple[str, int, int]]:
    """(phoneme, first sample, end sample) of each phoneme that is a sound, in order: a stress
    mark's time goes to the phoneme after it; spaces and punctuation (pauses) are none."""
    spans: list[tuple[str, int, int]] = []
    position = lead
    stress_from: int | None = None
    for phoneme, count in zip(phonemes, samples):
        if phoneme in "ˈˌ":
            stress_from = position if stress_from is None else stress_from
        elif phoneme not in _MARKS and count > 0:
            spans.append((phoneme, position if stress_from is None else stress_from, position + count))
            stress_from = None
        elif phoneme in _MARKS:
            stress_from = None
        position += count
    return spans


def word_spans(owners: Sequence[int], lead: int, samples: Sequence[int]) -> list[tuple[int, int, int]]:
    """(word index, first sample, end sample) of each word spoken in a piece, in order."""
    spans: list[tuple[int, int, int]] = []
    position = lead
    for owner, count in zip(owners, samples):
        if owner != NO_WORD and count > 0:
            if spans and spans[-1][0] == owner:
                spans[-1] = (owner, spans[-1][1], position + count)
            elif not spans or owner > spans[-1][0]:
                spans.append((owner, position, position + count))
        position += count
    return spans
