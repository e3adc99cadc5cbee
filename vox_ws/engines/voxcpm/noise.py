"""The CFM's starting noise as a function of (seed, step, element), drawn for every row at once.

A generator per request (the package's way: `torch.manual_seed`, then one `randn` a step)
costs one draw per row a step, and a draw's values depend on that generator's whole history.
Here the noise is counter-based, as Philox is: each element's value is a hash of the request's
seed, the step it is for and the element's index, turned into a normal by Box-Muller. So one
batched draw serves any set of rows, a row's noise is the same whatever else is in its batch or
whenever it was admitted, and it is the same on every device (integer arithmetic, exact).

The row's part of the hash (`row_key`: seed and step) is a few integer operations on the host,
where both are known; the element's part is tensor operations, the same few whatever the batch
(`draw`), and inside a compiled step graph they are fused with the rest.
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
# Multipliers of the lowbias32 integer hash (Chris Wellons' search), as its reference has them.
MULTIPLIERS = (0x7FEB352D, 0x846CA68B)


def mix32(x: int) -> int:
    """lowbias32: a bijection of 32-bit integers with good avalanche (host integers)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MULTIPLIERS[0]) & MASK32
    x ^= x >> 15
    x = (x * MULTIPLIERS[1]) & MASK32
    return x ^ (x >> 16)


def row_key(seed: int, step: int) -> int:
    """The 32-bit key of one row's noise at one step of its generation."""
    seed &= (1 << 64) - 1
    return mix32(mix32(mix32(step) ^ (seed & MASK32)) ^ (seed >> 32))


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32) held in int64, without ever leaving int64's
    range (a wrapped signed product is what C++ leaves undefined): in two 16-bit halves."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """`mix32` on a tensor of int64 holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, MULTIPLIERS[1])
    return x ^ (x >> 16)


def element_hashes(count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`mix32` of every element counter 0 .. 2*count - 1 (two uniforms per normal): [2, count],
    made once per shape and kept (`NoiseSource`)."""
    return _mix32(torch.arange(2 * count, dtype=torch.int64, device=device)).view(count, 2).t().contiguous()


def draw(keys: torch.Tensor, hashes: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Standard normal noise [rows, *shape] for rows keyed `keys` (int64 [rows], `row_key`),
    `hashes` from `element_hashes(prod(shape))` on the same device."""
    mixed = _mix32(keys.view(-1, 1, 1) ^ hashes.unsqueeze(0))                # [rows, 2, count]
    # The top 24 bits as a uniform in (0, 1), never 0: log(0) would be infinite.
    uniform = ((mixed >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    radius = torch.sqrt(-2.0 * torch.log(uniform[:, 0]))
    normal = radius * torch.cos((2.0 * math.pi) * uniform[:, 1])
    return normal.view(keys.shape[0], *shape).to(dtype)


class NoiseSource:
    """`draw` for one shape and device, its element hashes made once."""

    def __init__(self, shape: tuple[int, ...], device: torch.device | str) -> None:
        self.shape = shape
        self.hashes = element_hashes(math.prod(shape), device)

    def __call__(self, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return draw(keys, self.hashes, self.shape, dtype)


def noise_for(seed: int, step: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """One row's noise at one step, alone: what a batched draw gives that row ([1, *shape])."""
    keys = torch.tensor([row_key(seed, step)], dtype=torch.int64, device=device)
    return draw(keys, element_hashes(math.prod(shape), device), shape, dtype)
