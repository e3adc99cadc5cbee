"""The decode attention in place over the KV cache (`kv.attend_in_place`, `kv.lm_step(...,
in_place=True)`): FlexAttention over every slot's positions as one sequence, each row sent to its
slot and position by a block mask made of tensor operations, equal to the gather it replaces in
compiled steps; and a compiled graph's key names which attention it was traced with."""

from __future__ import annotations

import pytest
import torch

from vox_ws.engines.voxcpm.kv import (
    KV_BLOCK,
    RowPlaces,
    SlotKV,
    attend,
    attend_in_place,
    in_place_attention,
    in_place_mask,
    lm_step,
    slot_positions,
    whole_sequence,
)
from vox_ws.engines.voxcpm.loading import import_voxcpm

HEADS, KV_HEADS, DIM = 16, 2, 32
SLOTS = 4          # and the padding slot
MAX_LEN = 300      # held as 384 positions: three blocks a slot


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.set_num_threads(1)
    return import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                  device="cpu").tts_model


def slot_caches(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V laid out as `SlotKV` lays them (heads first, given as the transpose),
    random everywhere: what a row must not read is not zero either."""
    generator = torch.Generator().manual_seed(seed)
    stored = (KV_HEADS, SLOTS + 1, slot_positions(MAX_LEN), DIM)
    return (torch.randn(stored, generator=generator).transpose(0, 1),
            torch.randn(stored, generator=generator).transpose(0, 1))


# Rows at different slots and positions: the slot's last position, a block's last and the next
# block's first (a length crossing a block boundary), the first position, one in the middle, and
# a padding row in the padding slot.
SLOT_OF = [2, 0, 3, 1, 0, SLOTS]
POSITION_OF = [slot_positions(MAX_LEN) - 1, KV_BLOCK - 1, KV_BLOCK, 0, 200, 1]


def gathered(q, cache_k, cache_v, slots, positions):
    """What the eager step does: each row's prefix copied out of its slot, then `attend`."""
    length = int(positions.max()) + 1
    mask = (torch.arange(length).view(1, -1) <= positions.view(-1, 1)).view(-1, 1, 1, length)
    return attend(q, cache_k[slots, :, :length], cache_v[slots, :, :length], mask)


def in_place(q, cache_k, cache_v, slots, positions):
    mask = in_place_mask(torch.stack((slots, positions), dim=1), cache_k.shape[0], cache_k.shape[2])
    return attend_in_place(q, cache_k, cache_v, mask)


def attend_places(q, cache_k, cache_v, places):
    return attend_in_place(q, cache_k, cache_v, in_place_mask(places, cache_k.shape[0], cache_k.shape[2]))


def test_a_slot_holds_whole_blocks_and_its_cache_is_one_sequence_without_a_copy():
    assert slot_positions(MAX_LEN) == 384 and slot_positions(256) == 256 and slot_positions(1) == KV_BLOCK
    cache_k, _ = slot_caches()
    sequence = whole_sequence(cache_k)
    assert sequence.shape == (1, KV_HEADS, (SLOTS + 1) * 384, DIM)
    assert sequence.data_ptr() == cache_k.data_ptr()
    # Slot 3's position 5 of KV head 1 is the sequence's position 3 * 384 + 5.
    assert torch.equal(sequence[0, 1, 3 * 384 + 5], cache_k[3, 1, 5])


@pytest.mark.slow
def test_the_in_place_attention_equals_the_gather_compiled_whole_and_uncompiled():
    """Every row at its own slot and position, 8 query heads per KV head as the released LM: the
    in-place attention compiled with `fullgraph=True` (the slot count symbolic, as a step's graph
    takes it) and uncompiled, against the gather."""
    torch.manual_seed(0)
    cache_k, cache_v = slot_caches()
    slots, positions = torch.tensor(SLOT_OF), torch.tensor(POSITION_OF)
    q = torch.randn(len(SLOT_OF), HEADS, 1, DIM)
    want = gathered(q, cache_k, cache_v, slots, positions)
    with torch.inference_mode():
        assert in_place_attention("cpu"), "this CPU's compiler has FlexAttention's kernel: the tests need it"
        compiled = torch.compile(attend_places, fullgraph=True, dynamic=False)
        torch._dynamo.maybe_mark_dynamic(cache_k, 0)
        torch._dynamo.maybe_mark_dynamic(cache_v, 0)
        # The table the mask reads is the graph's input, as the step's `rows` (slot, position,
        # noise key) are.
        got = compiled(q, cache_k, cache_v, torch.stack((slots, positions, slots), dim=1))
        uncompiled = in_place(q, cache_k, cache_v, slots, positions)
    assert got.shape == (len(SLOT_OF), HEADS, DIM)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(uncompiled, want, rtol=1e-4, atol=1e-5)
    # A query head reads its own KV head, and a row its own slot.
    swapped = in_place(q, cache_k.flip(1), cache_v.flip(1), slots, positions)
    assert not torch.allclose(swapped, want)
    other = in_place(q, cache_k, cache_v, slots.roll(1), positions)
    assert not torch.allclose(other[1:4], want[1:4])


def test_the_in_place_step_writes_and_attends_as_the_gathered_step(model):
    """Both LMs' `lm_step` on two copies of the same caches, uncompiled: the same hidden states,
    and the same K and V written into every slot."""
    torch.manual_seed(0)
    slots = torch.tensor([1, 0, 2, 2])
    positions = torch.tensor([130, 5, 127, 0])
    at = RowPlaces(slots, positions, torch.arange(int(positions.max()) + 1))
    for lm in (model.base_lm, model.residual_lm):
        kv = [SlotKV(lm, 3, 200, "cpu", torch.float32) for _ in range(2)]
        for a, b in zip(kv[0].k + kv[0].v, kv[1].k + kv[1].v):
            filled = torch.randn(a.shape) * 0.5
            a.copy_(filled)
            b.copy_(filled)
        x = torch.randn(len(slots), lm.config.hidden_size)
        with torch.inference_mode():
            want = lm_step(lm, kv[0].k, kv[0].v, x, at)
            got = lm_step(lm, kv[1].k, kv[1].v, x, at, places=torch.stack((slots, positions), dim=1))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for a, b in zip(kv[1].k + kv[1].v, kv[0].k + kv[0].v):
            torch.testing.assert_close(a, b)


def test_which_attention_a_graph_uses_is_part_of_its_key(model, tmp_path):
    """The compiled advance and the whole step name their attention in their graphs' context,
    so a cache of gathered graphs is never loaded for the in-place step, nor the other way."""
    from vox_ws.engines.voxcpm.compiled import CompiledStep, adapted_advance_in_place
    from vox_ws.engines.voxcpm.vae import BatchedStreamingVAE
    from vox_ws.engines.voxcpm.whole_step import WholeSteps

    compiled = CompiledStep(model, (1,), cache_dir=tmp_path / "cache")
    assert compiled.in_place and compiled._advance.fn is adapted_advance_in_place
    assert compiled._advance.context.endswith("attention in place")
    decoder = BatchedStreamingVAE(model.audio_vae, 2)
    contexts = {in_place: WholeSteps(compiled.store, model, decoder, (1,), in_place=in_place)._graphs[(10, True)]
                .context for in_place in (True, False)}
    assert contexts[True] != contexts[False] and contexts[False].endswith("attention gathered")
    args = (torch.zeros(1, 2),)
    paths = {compiled.store.path("step", context, args, {}) for context in contexts.values()}
    assert len(paths) == 2
    assert WholeSteps(compiled.store, model, decoder, (1,)).in_place == compiled.in_place
