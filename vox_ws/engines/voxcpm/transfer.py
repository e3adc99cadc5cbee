"""The step's small host-side inputs (slots, positions, row indices, adapter slots) onto the device
without stalling it.

`torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host until the
GPU has drained the work queued before it: the step would wait on itself before every kernel it
queues. From pinned memory the copy is queued like a kernel; PyTorch's caching host allocator
keeps a pinned block until the copy that reads it has run, so a block is never reused early.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], device: torch.device, dtype: torch.dtype = torch.long
              ) -> torch.Tensor:
    """`values` as a tensor on `device`, queued without blocking where the device is a GPU."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`, queued without blocking where the device is a GPU."""
    if device.type == "cpu" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
