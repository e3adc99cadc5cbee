"""KV caches in slots, and one decode step of the model's LMs over rows at different positions."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class SlotKV:
    """K and V for `slots` requests of up to `max_len` positions each, one tensor per layer
    ([slots + 1, kv heads, max_len, head dim]: a compiled step writes each in place, where one
    tensor for every layer would be copied whole at each layer's write), and one slot more,
    `padding_slot`, where the rows a compiled step pads its batch with write (never a
    request's: a padding row writing into a real row's slot would race with it)."""

    def __init__(self, lm: nn.Module, slots: int, max_len: int, device: Any, dtype: torch.dtype) -> None:
        cfg = lm.config
        head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.padding_slot = slots
        shape = (slots + 1, cfg.num_key_value_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.max_len = max_len

    def fill(self, slots: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The slots `slots` (int64 [rows]) from a prefill of as many rows: its per-layer (K, V),
        [rows, kv heads, length, head dim], each row's prompt and then, up to the longest
        prompt, padding that the row writes over before it ever attends to it. The slots are
        zeroed first: a masked position's value still enters the attention's sum (as 0 x value),
        so a previous request's must be finite. Two indexed writes a layer, whatever the rows."""
        length = caches[0][0].size(2)
        for layer, (k, v) in enumerate(caches):
            for cache, given in ((self.k[layer], k), (self.v[layer], v)):
                cache.index_fill_(0, slots, 0)
                cache[slots, :, :length] = given

def slot_bytes(lm: nn.Module, max_len: int, dtype: torch.dtype) -> int:
    """What one slot of a `SlotKV` for this LM holds: K and V at every layer and position."""
    cfg = lm.config
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    return (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * max_len * head_dim
            * torch.empty(0, dtype=dtype).element_size())


def key_positions(positions: list[int], device: Any) -> torch.Tensor:
    """The key positions a decode step attends over: 0 .. the furthest row's position. Its
    length is the step's attention length, read by `lm_step` from the tensor's shape (a compiled
    step takes it as a symbolic size: one graph for every length, and no host sync to learn it)."""
    return torch.arange(max(positions) + 1, device=device)


class RowPlaces(NamedTuple):
    """Where a step's rows sit: each row's KV slot and position, and the key positions the step
    attends over (`key_positions`)."""

    slots: torch.Tensor
    positions: torch.Tensor
    keys_at: torch.Tensor


def lm_step(lm: nn.Module, cache_k: list[torch.Tensor], cache_v: list[torch.Tensor], x: torch.Tensor,
            at: RowPlaces) -> torch.Tensor:
    """MiniCPMModel.forward_step for a batch whose rows sit at different positions in their own
    KV slots (`SlotKV.k`, `.v`). x: [B, H] -> [B, H]. Writes each row's new K and V into its
    slot in place, then attends over the slot's keys up to its own position."""
    slots, positions, keys_at = at
    batch = x.shape[0]
    length = keys_at.shape[0]
    if lm.rope_emb is not None:
        cos = lm.rope_emb.cos_cached[positions].view(batch, 1, 1, -1)
        sin = lm.rope_emb.sin_cached[positions].view(batch, 1, 1, -1)
    mask = (keys_at.view(1, -1) <= positions.view(-1, 1)).view(batch, 1, 1, length)
    hidden = x
    for index, layer in enumerate(lm.layers):
        attn = layer.self_attn
        residual = hidden
        h = layer.input_layernorm(hidden)
        q = attn.q_proj(h).view(batch, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(batch, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(batch, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        if lm.rope_emb is not None:
            q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        layer_k, layer_v = cache_k[index], cache_v[index]
        layer_k[slots, :, positions] = k[:, :, 0]
        layer_v[slots, :, positions] = v[:, :, 0]
        keys, values = layer_k[slots, :, :length], layer_v[slots, :, :length]
        out = attend(q, keys, values, mask)
        out = attn.o_proj(out.reshape(batch, attn.num_heads * attn.head_dim))
        hidden = residual + _depth_scaled(layer, out)
        residual = hidden
        hidden = residual + _depth_scaled(layer, layer.mlp(layer.post_attention_layernorm(hidden)))
    return lm.norm(hidden)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One decode position's attention with grouped heads, in the form fast kernels take.

    q [B, H, 1, D]; keys, values [B, KV, L, D] (KV heads, each serving H / KV query heads, as
    `enable_gqa` pairs them: query head h reads KV head h // (H / KV)); mask [B, 1, 1, L].
    -> [B, H, D]. The query heads of each KV head are folded into the query length, so the
    head counts are equal and K/V are read once, not repeated per query head: the
    memory-efficient kernel takes a mask only with equal head counts, and FlashAttention takes
    none (`enable_gqa` with a mask leaves only the math kernel, with K/V repeated in memory)."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask).reshape(batch, heads, dim)


def attention_kernel(lm: nn.Module, device: Any, dtype: torch.dtype) -> str:
    """The SDPA kernel `attend` runs on for this LM, device and dtype."""
    cfg = lm.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.kv_channels or cfg.hidden_size // heads
    q = torch.zeros(2, heads, 1, head_dim, device=device, dtype=dtype)
    keys = torch.zeros(2, kv_heads, 16, head_dim, device=device, dtype=dtype)
    mask = torch.ones(2, 1, 1, 16, device=device, dtype=torch.bool)
    return sdpa_kernel_of(attend, (q, keys, keys, mask))


def sdpa_kernel_of(call: Any, args: tuple) -> str:
    """The SDPA kernel `call(*args)` runs on: the first of PyTorch's own order of preference
    (flash, memory-efficient, math) that takes its inputs."""
    import warnings

    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")     # each kernel that declines says why
                call(*args)
        except RuntimeError:
            continue
        return backend.name.lower()
    return "none"


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """minicpm4's apply_rotary_pos_emb for one tensor (in float32, as there), written here so that
    a compiled step imports nothing while it runs (an import is a guard a saved graph cannot keep)."""
    x32 = x.to(torch.float32)
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)


def _depth_scaled(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    if layer.use_mup:
        return h * (layer.scale_depth / math.sqrt(layer.num_hidden_layers))
    return h

