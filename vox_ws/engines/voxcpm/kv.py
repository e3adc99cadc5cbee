"""KV caches in slots, and one decode step of the model's LMs over rows at different positions."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SlotKV:
    """Per-layer K and V for `slots` requests of up to `max_len` positions each."""

    def __init__(self, lm: nn.Module, slots: int, max_len: int, device: Any, dtype: torch.dtype) -> None:
        cfg = lm.config
        head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len

    def fill(self, slot: int, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # Zero the whole slot first: masked-out positions must hold finite values.
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()
        length = caches[0][0].size(2)
        for layer, (k, v) in enumerate(caches):
            self.k[layer, slot, :, :length] = k[0]
            self.v[layer, slot, :, :length] = v[0]



def slot_bytes(lm: nn.Module, max_len: int, dtype: torch.dtype) -> int:
    """What one slot of a `SlotKV` for this LM holds: K and V at every layer and position."""
    cfg = lm.config
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * max_len * head_dim * torch.empty(0, dtype=dtype).element_size()


def lm_step(lm: nn.Module, kv: SlotKV, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """MiniCPMModel.forward_step for a batch whose rows sit at different positions in their own
    KV slots. x: [B, H] -> [B, H]."""
    from voxcpm.modules.minicpm4.model import apply_rotary_pos_emb

    batch = x.shape[0]
    length = int(positions.max().item()) + 1
    if lm.rope_emb is not None:
        cos = lm.rope_emb.cos_cached[positions].view(batch, 1, 1, -1)
        sin = lm.rope_emb.sin_cached[positions].view(batch, 1, 1, -1)
    mask = (torch.arange(length, device=x.device).view(1, -1) <= positions.view(-1, 1)).view(batch, 1, 1, length)
    contiguous = bool(torch.equal(slots, torch.arange(batch, device=slots.device)))
    hidden = x
    for index, layer in enumerate(lm.layers):
        attn = layer.self_attn
        residual = hidden
        h = layer.input_layernorm(hidden)
        q = attn.q_proj(h).view(batch, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(batch, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(batch, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        if lm.rope_emb is not None:
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        layer_k, layer_v = kv.k[index], kv.v[index]
        layer_k[slots, :, positions] = k[:, :, 0]
        layer_v[slots, :, positions] = v[:, :, 0]
        if contiguous:
            keys, values = layer_k[:batch, :, :length], layer_v[:batch, :, :length]
        else:
            keys, values = layer_k[slots, :, :length], layer_v[slots, :, :length]
        out = F.scaled_dot_product_attention(q.contiguous(), keys.contiguous(), values.contiguous(), attn_mask=mask,
                                             enable_gqa=True)
        out = attn.o_proj(out.transpose(1, 2).reshape(batch, attn.num_heads * attn.head_dim))
        hidden = residual + _depth_scaled(layer, out)
        residual = hidden
        hidden = residual + _depth_scaled(layer, layer.mlp(layer.post_attention_layernorm(hidden)))
    return lm.norm(hidden)


def _depth_scaled(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    if layer.use_mup:
        return h * (layer.scale_depth / math.sqrt(layer.num_hidden_layers))
    return h

