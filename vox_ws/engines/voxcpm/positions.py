"""What a VoxCPM2 prompt costs a KV slot, counted without torch: its tokens, its positions (text,
voice prompt, continuation), and whether it fits a slot with the audio it may generate. Read by
the engine (with the package's model and prompt caches) and by the server process's copy of its
text rules (with `tokens.TextTokens` and the voices' summaries, `VoxCPMVoices.summary`), which
cuts and checks texts where the model is not.
"""

from __future__ import annotations

import re
import threading
import weakref
from typing import Any, Callable

# The package caps generation at this many steps per target-text token (+10).
STEPS_PER_TOKEN = 6.0
# Texts whose tokens each tokenizer keeps: a segment is counted when it is cut, checked when it
# is queued and built when it is prefilled, on three threads; the tokenizer runs once for it.
TOKENS_KEPT = 256
_kept: "weakref.WeakKeyDictionary[Any, dict[str, list[int]]]" = weakref.WeakKeyDictionary()
_kept_lock = threading.Lock()


def tokenizer_of(model: Any) -> Callable[[str], list[int]]:
    """The package's tokenizer of a model (`text_tokenizer`), or a tokenizer given as it is."""
    return getattr(model, "text_tokenizer", model)


def tokens(model: Any, text: str) -> list[int]:
    """The text's tokens (`model.text_tokenizer(text)`, or a tokenizer's own), kept for the
    `TOKENS_KEPT` texts asked last."""
    tokenizer = tokenizer_of(model)
    with _kept_lock:
        kept = _kept.setdefault(tokenizer, {})
        found = kept.pop(text, None)
        if found is not None:
            kept[text] = found                   # the most recent last
            return found
    made = list(tokenizer(text))
    with _kept_lock:
        kept[text] = made
        while len(kept) > TOKENS_KEPT:
            del kept[next(iter(kept))]
    return made


def frames(cache: dict, features: str) -> int:
    """A voice prompt's frames of `features` ("ref_audio_feat", "audio_feat"): the tensor's rows
    in the engine's prompt cache, the count in the server's summary of it."""
    if features in cache:
        return int(cache[features].shape[0])
    return int(cache.get(f"{features}_frames", 0))


def prompt_positions(model: Any, target_text: str, cache: dict | None) -> tuple[int, int]:
    """(positions the prompt of `prompt.build_prompt` takes, tokens of the target text), counted
    without building it: cheap enough for the event loop, and no torch."""
    mode = "zero_shot" if cache is None else cache.get("mode", "continuation")
    text = target_text
    if mode in ("continuation", "ref_continuation"):
        text = cache.get("prompt_text", "") + target_text
    positions = len(tokens(model, text)) + 1                 # + audio_start
    if mode in ("reference", "ref_continuation"):
        positions += frames(cache, "ref_audio_feat") + 2    # ref_start ... ref_end
    if mode in ("continuation", "ref_continuation"):
        positions += frames(cache, "audio_feat")
    return positions, len(tokens(model, target_text))


def max_steps(target_tokens: int, max_len: int) -> int:
    """The most generation steps a request of `target_tokens` tokens and option `max_len` takes."""
    return min(int(target_tokens * STEPS_PER_TOKEN + 10), max_len)


def fits(positions: int, target_tokens: int, max_len: int, slot_positions: int) -> bool:
    """Whether a prompt and its longest generation fit a KV slot of `slot_positions`."""
    return positions + max_steps(target_tokens, max_len) <= slot_positions


def clean_text(text: str) -> str:
    """The package's own clean-up (VoxCPM._generate): newlines and runs of whitespace to one space."""
    return re.sub(r"\s+", " ", text.replace("\n", " ")).strip()
