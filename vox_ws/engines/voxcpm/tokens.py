"""VoxCPM2's text tokens in a process without torch (the server's, which cuts and checks texts):
the tokenizer the package itself loads from the checkpoint (transformers' `LlamaTokenizerFast`,
whose tokenizer classes import no torch), each multi-character Chinese token split into its
characters as the package's `mask_multichar_chinese_tokens` does. The same ids as the model's
`text_tokenizer` (tests/test_voxcpm_text.py)."""

from __future__ import annotations

from typing import Any


def _chinese(token: str) -> bool:
    return len(token) >= 2 and all("\u4e00" <= c <= "\u9fff" for c in token)


class TextTokens:
    """Callable: a text's token ids."""

    def __init__(self, checkpoint: str) -> None:
        from transformers import LlamaTokenizerFast

        self._tokenizer: Any = LlamaTokenizerFast.from_pretrained(checkpoint)
        self._multichar = frozenset(token for token in self._tokenizer.vocab if _chinese(token))

    def __call__(self, text: str) -> list[int]:
        pieces = []
        for token in self._tokenizer.tokenize(text):
            bare = token.replace("\u2581", "")
            pieces.extend(bare if bare in self._multichar else [token])
        return list(self._tokenizer.convert_tokens_to_ids(pieces))
