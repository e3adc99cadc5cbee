"""The CFM's counter-based noise (`vox_ws/engines/voxcpm/noise.py`): a row's values depend on its
seed, its step and nothing else, the tensor hash equals the host's, and the draw is normal."""

from __future__ import annotations

import math

import torch

from vox_ws.engines.voxcpm.noise import NoiseSource, _mix32, mix32, noise_for, row_key

SHAPE = (64, 4)


def test_the_tensor_hash_is_the_host_hash_over_the_whole_32_bit_range():
    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    assert _mix32(torch.tensor(values, dtype=torch.int64)).tolist() == [mix32(v) for v in values]
    assert len({mix32(v) for v in range(10_000)}) == 10_000         # a bijection: no two alike


def test_a_batched_draw_gives_each_row_what_it_gets_alone_in_any_order():
    source = NoiseSource(SHAPE, "cpu")
    rows = [(7, 0), (7, 1), (123456789012345678, 3), (0, 0), (2 ** 63 - 1, 40)]
    keys = torch.tensor([row_key(seed, step) for seed, step in rows])
    together = source(keys, torch.float32)
    reversed_ = source(keys.flip(0), torch.float32).flip(0)
    for i, (seed, step) in enumerate(rows):
        assert torch.equal(together[i:i + 1], noise_for(seed, step, SHAPE))
    assert torch.equal(together, reversed_)
    # Seeds and steps each change the noise.
    assert not torch.equal(together[0], together[1])
    assert not torch.equal(noise_for(7, 0, SHAPE), noise_for(8, 0, SHAPE))
    assert not torch.equal(noise_for(2 ** 32 + 7, 0, SHAPE), noise_for(7, 0, SHAPE))    # the seed's high half


def test_the_draw_is_standard_normal_and_finite():
    source = NoiseSource(SHAPE, "cpu")
    keys = torch.tensor([row_key(seed, step) for seed in range(40) for step in range(25)])
    noise = source(keys, torch.float32)
    assert noise.shape == (1000, *SHAPE) and torch.isfinite(noise).all()
    assert abs(noise.mean().item()) < 0.01 and abs(noise.std().item() - 1) < 0.01
    # The tails of a normal, no more and no less: |z| > 3 for 0.27 % of draws.
    tail = (noise.abs() > 3).float().mean().item()
    assert 0.0020 < tail < 0.0034, tail
    # Neighbouring rows are uncorrelated.
    flat = noise.view(1000, -1)
    correlation = torch.corrcoef(flat[:50])
    off_diagonal = correlation[~torch.eye(50, dtype=torch.bool)]
    assert off_diagonal.abs().max().item() < 4 / math.sqrt(flat.shape[1])
    assert source(keys[:3], torch.bfloat16).dtype == torch.bfloat16
