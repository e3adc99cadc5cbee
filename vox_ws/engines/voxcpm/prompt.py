"""The model inputs for one request: the prompt sequence, counted cheaply or built in full.

Mirrors the package's `_generate_with_prompt_cache`, with the voice prompt (reference audio,
continuation audio and transcript) taken from a voice's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .positions import clean_text, prompt_positions, tokens

__all__ = ["Prompt", "build_prompt", "clean_text", "prompt_positions", "tokens"]


@dataclass
class Prompt:
    """Model inputs for one request, as `_generate_with_prompt_cache` builds them."""

    text_tokens: torch.Tensor   # [T] int
    text_mask: torch.Tensor     # [T] int
    audio_feat: torch.Tensor    # [T, P, D]
    audio_mask: torch.Tensor    # [T] int
    target_tokens: int          # tokens of the target text alone (the length cap counts these)


def build_prompt(model: Any, target_text: str, cache: dict | None) -> Prompt:
    """The token/feature sequence for one request (mirrors `_generate_with_prompt_cache`)."""
    mode = "zero_shot" if cache is None else cache.get("mode", "continuation")
    text = target_text
    if mode in ("continuation", "ref_continuation"):
        text = cache.get("prompt_text", "") + target_text
    text_tokens = torch.cat([torch.LongTensor(tokens(model, text)),
                             torch.tensor([model.audio_start_token], dtype=torch.int32)])
    n_text = text_tokens.shape[0]
    zeros_feat = torch.zeros((n_text, model.patch_size, model.audio_vae.latent_dim), dtype=torch.float32)
    ones_text = torch.ones(n_text, dtype=torch.int32)
    zeros_text = torch.zeros(n_text, dtype=torch.int32)
    seq_tokens, seq_feat, seq_tmask, seq_amask = [], [], [], []
    if mode in ("reference", "ref_continuation"):
        ref_tokens, ref_feats, ref_t_mask, ref_a_mask = model._make_ref_prefix(cache["ref_audio_feat"],
                                                                               text_tokens.device)
        seq_tokens.append(ref_tokens)
        seq_feat.append(ref_feats)
        seq_tmask.append(ref_t_mask)
        seq_amask.append(ref_a_mask)
    seq_tokens.append(text_tokens)
    seq_feat.append(zeros_feat)
    seq_tmask.append(ones_text)
    seq_amask.append(zeros_text)
    if mode in ("continuation", "ref_continuation"):
        prompt_feat = cache["audio_feat"]
        n_audio = prompt_feat.size(0)
        seq_tokens.append(torch.zeros(n_audio, dtype=torch.int32))
        seq_feat.append(prompt_feat)
        seq_tmask.append(torch.zeros(n_audio, dtype=torch.int32))
        seq_amask.append(torch.ones(n_audio, dtype=torch.int32))
    return Prompt(
        text_tokens=torch.cat(seq_tokens),
        text_mask=torch.cat(seq_tmask),
        audio_feat=torch.cat(seq_feat, dim=0),
        audio_mask=torch.cat(seq_amask),
        target_tokens=len(tokens(model, target_text)),
    )
