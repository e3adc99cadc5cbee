"""KV caches in slots, and one decode step of the model's LMs over rows at different positions.

A decode step attends each row over its own slot's keys up to its position, one of two ways:

- the gather (`lm_step` without `places`): each row's K and V prefix copied out of its slot
  (`layer_k[slots, :, :length]`), then SDPA (`attend`) with a mask. The copy is of every row's
  whole prefix, twice a layer: at thousands of positions it costs more than the attention. The
  eager step's way (FlexAttention uncompiled materialises the scores over the whole cache), and a
  compiled step's where the in-place attention is not chosen (`in_place_attention`);
- in place (`lm_step(..., places=...)`): FlexAttention over the cache itself, every slot's
  positions seen as one sequence of a batch of one (`SlotKV` keeps that view free) and a block
  mask, made from tensor operations inside the graph (`in_place_mask`), that sends each row to
  its slot's blocks up to its position. Nothing is copied; what a row reads is what it attends.
  For a compiled step only (FlexAttention's fused kernel is made by the compiler).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

log = logging.getLogger("vox_ws.engines.voxcpm")

# Positions per block of the in-place attention's block mask (FlexAttention's default): a slot
# holds a whole number of them, so no block straddles two slots.
KV_BLOCK = 128


def slot_positions(max_len: int) -> int:
    """The positions a slot holds for `max_len`: rounded up to whole `KV_BLOCK`s."""
    return -(-max_len // KV_BLOCK) * KV_BLOCK


class SlotKV:
    """K and V for `slots` requests of up to `max_len` positions each, one tensor per layer
    ([slots + 1, kv heads, positions, head dim]: a compiled step writes each in place, where one
    tensor for every layer would be copied whole at each layer's write), and one slot more,
    `padding_slot`, where the rows a compiled step pads its batch with write (never a
    request's: a padding row writing into a real row's slot would race with it).

    Each tensor is stored heads first ([kv heads, slots + 1, positions, head dim], given as its
    transpose): so every slot's positions of a KV head follow each other in memory, and the
    in-place attention sees the whole cache as one sequence of (slots + 1) x positions for a
    batch of one without a copy (`whole_sequence`). A slot holds `max_len` rounded up to whole
    `KV_BLOCK`s (the positions past `max_len` are never written)."""

    def __init__(self, lm: nn.Module, slots: int, max_len: int, device: Any, dtype: torch.dtype) -> None:
        cfg = lm.config
        head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.padding_slot = slots
        stored = (cfg.num_key_value_heads, slots + 1, slot_positions(max_len), head_dim)
        self.k = [torch.zeros(stored, device=device, dtype=dtype).transpose(0, 1)
                  for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(stored, device=device, dtype=dtype).transpose(0, 1)
                  for _ in range(cfg.num_hidden_layers)]
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
    return (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * slot_positions(max_len) * head_dim
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
            at: RowPlaces, places: torch.Tensor | None = None) -> torch.Tensor:
    """MiniCPMModel.forward_step for a batch whose rows sit at different positions in their own
    KV slots (`SlotKV.k`, `.v`). x: [B, H] -> [B, H]. Writes each row's new K and V into its
    slot in place, then attends over the slot's keys up to its own position: through the
    gather, or in place where `places` is given (`in_place_mask`'s table of the same slots and
    positions; see the module's docstring)."""
    slots, positions, keys_at = at
    batch = x.shape[0]
    length = keys_at.shape[0]
    if lm.rope_emb is not None:
        cos = lm.rope_emb.cos_cached[positions].view(batch, 1, 1, -1)
        sin = lm.rope_emb.sin_cached[positions].view(batch, 1, 1, -1)
    if places is not None:
        # One block mask for every layer: the slots and positions are the same at each.
        block_mask = in_place_mask(places, cache_k[0].shape[0], cache_k[0].shape[2])
    else:
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
        if places is not None:
            out = attend_in_place(q, layer_k, layer_v, block_mask)
        else:
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


def whole_sequence(cache: torch.Tensor) -> torch.Tensor:
    """A `SlotKV` layer's K or V ([slots, kv heads, positions, D], stored heads first) as one
    sequence of every slot's positions for a batch of one: [1, kv heads, slots x positions, D].
    A view: nothing is copied."""
    slots, kv_heads, positions, dim = cache.shape
    return cache.transpose(0, 1).view(1, kv_heads, slots * positions, dim)


def in_place_mask(places: torch.Tensor, slot_count: int, slot_len: int) -> BlockMask:
    """The block mask of the in-place attention for the rows of `places` (int64 [B, >= 2]: each
    row's slot, then its position): row b (query batch b) attends to the blocks of its slot in
    the whole sequence (`whole_sequence`: `slot_count` slots of `slot_len` positions) before the
    one holding its position, whole (FlexAttention's full blocks: no mask read), and in that
    block to the keys at or before its position (its one partial block). Tensor operations
    alone (no host work, nothing read back): it is made inside the compiled graph at each step.

    `places` must be an input of the graph as it is (the whole step's `rows`; a compiled
    advance's own), not a tensor computed in it: the mask reads it per row, and a CPU's kernel
    reads a computed one wrong, or fails to compile it (torch 2.13). Every row lists all the
    sequence's blocks (its own slot's first), as many as a CPU's kernel wants (its block mask
    must span the whole key length; the kernels read only the first `kv_num_blocks` of them):
    one int32 per block and row. The full blocks are given apart, as a CPU's decoding kernel
    does not compile without them (torch 2.13)."""
    slots, positions = places[:, 0], places[:, 1]
    rows = places.shape[0]
    per_slot = slot_len // KV_BLOCK
    blocks = slot_count * per_slot
    last = torch.div(positions, KV_BLOCK, rounding_mode="floor")
    first = (slots * per_slot).view(rows, 1)
    listed = torch.arange(blocks, device=places.device).view(1, -1)
    full = ((first + listed) % blocks).to(torch.int32).view(rows, 1, 1, blocks)
    partial = ((first + last.view(rows, 1) + listed) % blocks).to(torch.int32).view(rows, 1, 1, blocks)
    one = torch.ones(rows, 1, 1, dtype=torch.int32, device=places.device)

    def up_to_position(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        # Exact by itself (uncompiled, FlexAttention reads this alone, over every key); the
        # compiled kernel reads it in the partial block only.
        start = places[b, 0] * slot_len
        return (kv_idx >= start) & (kv_idx <= start + places[b, 1])

    return BlockMask.from_kv_blocks(one, partial, last.to(torch.int32).view(rows, 1, 1), full,
                                    BLOCK_SIZE=KV_BLOCK, mask_mod=up_to_position,
                                    seq_lengths=(1, slot_count * slot_len), compute_q_blocks=False)


def attend_in_place(q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, block_mask: BlockMask
                    ) -> torch.Tensor:
    """The decode attention over a `SlotKV` layer as it is: q [B, H, 1, D] against every slot's
    keys (`whole_sequence`, a batch of one), each row kept to its slot and positions by
    `block_mask` (`in_place_mask`). -> [B, H, D]. The scale is SDPA's default, 1 / sqrt(D), as
    `attend`'s."""
    # The query copied into a tensor of its own: one the compiler sees as a view of a 2-D buffer
    # (the projection's output) fails a CPU's FlexAttention lowering, which reads the shape of
    # the buffer under the view (torch 2.13). B x H x D values.
    query = q.clone(memory_format=torch.contiguous_format)
    out = flex_attention(query, whole_sequence(layer_k), whole_sequence(layer_v), block_mask=block_mask,
                         enable_gqa=True)
    return out.view(q.shape[0], q.shape[1], q.shape[3])


def attention_name(in_place: bool) -> str:
    """How a compiled step attends, in words (part of its graphs' keys, and what the log says)."""
    return "in place" if in_place else "gathered"


def in_place_attention(device: Any) -> bool:
    """Whether this PyTorch's compiler has FlexAttention's fused kernel for `device`, so that a
    compiled step there may attend in place (else through the gather); whether it compiles for
    the model is `attention_choice.choose_attention`'s question (a GPU's probe).

    Measured (docs/PERFORMANCE.md, `python -m benchmarks.attention --in-place`, compiled both):
    on this CPU it is 3-5x faster than the gather at 8 to 64 rows of 1,000 to 8,000 positions
    (where the gather's copy is most of the time), about as fast at one row, and 0.1-2 ms
    slower at 100 positions (1.1-1.4x), where neither costs much. On a GPU the gather is the
    same copy of every row's prefix; the device check times both there (its "attention" step),
    the in-place graph with a static batch, as FlexAttention's decoding kernel wants it
    (`flex_kernels.py`). Nothing measured yet asks for another choice on a GPU, so one rule for
    both, and no setting. Where the kernel is missing (a CPU without AVX2, a CUDA build without
    Triton), the gather, and the log says so once."""
    why_not = in_place_unavailable(torch.device(device).type)
    if why_not is not None:
        _log_once(f"compiled steps on {torch.device(device).type} attend through the gather: {why_not}")
    return why_not is None


def in_place_unavailable(device_type: str) -> str | None:
    """Why FlexAttention's fused kernel cannot be compiled for `device_type`, or None."""
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "FlexAttention's GPU kernel needs Triton"
    if device_type == "cpu":
        try:
            from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
        except ImportError:
            return f"torch {torch.__version__} has no FlexAttention kernel for a CPU"
        return None if check_cpu_supported() else "FlexAttention's CPU kernel needs AVX2 (and no macOS)"
    return f"no FlexAttention kernel is known here for {device_type}"


@functools.lru_cache(maxsize=None)
def _log_once(line: str) -> None:
    log.warning(line)


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

