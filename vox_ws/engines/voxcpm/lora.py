"""Per-row LoRA: every row of a batch speaks with its own adapter, or none, in one step.

The voxcpm package holds one adapter at a time: a `LoRALinear` per adapted layer with one
`lora_A` [r, in] and `lora_B` [out, r]. Here each of those layers becomes a `RowLoRALinear`
holding every adapter slot's weights stacked, slot s in rows s*R:(s+1)*R of

    A [(S+1)*R, in]      B^T [(S+1)*R, out]      scaling [S+1]

(R: the slot rank, a smaller rank zero-padded; the last slot, `S`, is all zeros and stands for
"no adapter"). A forward gathers each row's own slot, `(x A_slot^T) B_slot^T * scaling_slot`: one
batched matmul pair serves any mix of adapters, with shapes that do not depend on the mix (a
compiled step takes the rows' slots as one more input: one graph for every mix). A row's
arithmetic touches only its own adapter's weights: no other loaded adapter, however large its
weights, can change its audio (a row without one gathers the zero slot, whose delta is exactly 0).
A batch whose rows all use one adapter takes that slot's block alone; a batch without adapters,
nothing.

Which slot each row uses is set by the runner around each call (`RowAdapters.rows`): the LMs
see the batch's rows in order, the LocDiT its rows twice (the CFG's conditioned and
unconditioned halves).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .transfer import to_device

NO_ADAPTER = -1


class RowAdapters:
    """The adapter slots of one model: each slot's scaling, and which slot the rows of the
    forward in progress use. Shared by every `RowLoRALinear` of the model."""

    def __init__(self, slots: int, rank: int, device: Any, dtype: torch.dtype) -> None:
        self.slots = slots
        self.rank = rank
        self.scaling = [0.0] * slots
        self.dtype = dtype
        self._device = device
        self.single: int | None = None              # every row uses this slot
        self.row_slots: torch.Tensor | None = None  # [rows] long: each row's slot (`slots`: none)
        # Held for the whole of `rows`: the selection is shared by every layer, and a thread other
        # than the one that steps (a background compile's reader, comparing a bucket with eager)
        # selects rows of its own; its calls and the step's take turns, never mixing selections.
        self._selecting = threading.RLock()

    @contextmanager
    def rows(self, slots: list[int], gathered: bool = False) -> Iterator[None]:
        """For the calls inside: row i uses adapter slot `slots[i]` (`NO_ADAPTER`: none).
        `gathered`: every mix through the gather, none and one adapter too (a compiled graph then
        serves them all). One thread's calls at a time: another thread's wait for these to end."""
        used = set(slots)
        with self._selecting:
            self.single, self.row_slots = None, None
            if gathered or used != {NO_ADAPTER}:
                if len(used) == 1 and not gathered:
                    self.single = slots[0]
                else:
                    self.row_slots = to_device([self.slots if s == NO_ADAPTER else s for s in slots],
                                               torch.device(self._device))
            try:
                yield
            finally:
                self.single, self.row_slots = None, None


class RowLoRALinear(nn.Module):
    """A linear layer with every adapter slot's LoRA weights; each row adds its own slot's."""

    def __init__(self, base: nn.Module, adapters: RowAdapters) -> None:
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.in_features, self.out_features = base.in_features, base.out_features
        self.adapters = adapters
        width = (adapters.slots + 1) * adapters.rank            # and the zero slot
        like = dict(device=base.lora_A.device, dtype=base.lora_A.dtype)
        self.register_buffer("stacked_a", torch.zeros(width, self.in_features, **like), persistent=False)
        self.register_buffer("stacked_bt", torch.zeros(width, self.out_features, **like), persistent=False)
        self.register_buffer("slot_scaling", torch.zeros(adapters.slots + 1, **like), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        adapters = self.adapters
        if adapters.single is not None:
            block = slice(adapters.single * adapters.rank, (adapters.single + 1) * adapters.rank)
            delta = F.linear(x, self.stacked_a[block]) @ self.stacked_bt[block]
            return out + delta * adapters.scaling[adapters.single]
        if adapters.row_slots is not None:
            slots, rank = adapters.row_slots, adapters.rank
            a = self.stacked_a.view(-1, rank, self.in_features)[slots]          # [rows, R, in]
            bt = self.stacked_bt.view(-1, rank, self.out_features)[slots]       # [rows, R, out]
            rows = x.reshape(x.shape[0], -1, self.in_features)
            delta = (rows @ a.transpose(1, 2)) @ bt * self.slot_scaling[slots].view(-1, 1, 1)
            return out + delta.view(out.shape)
        return out

    def put(self, slot: int, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, scaling: float) -> None:
        """Write one slot's weights and scaling (None: zeros); a rank under the slot's is zero-padded."""
        rank = self.adapters.rank
        block = slice(slot * rank, (slot + 1) * rank)
        self.stacked_a[block].zero_()
        self.stacked_bt[block].zero_()
        self.slot_scaling[slot] = 0.0
        if lora_a is not None and lora_b is not None:
            r = lora_a.shape[0]
            self.stacked_a[block][:r] = lora_a.to(self.stacked_a)
            self.stacked_bt[block][:r] = lora_b.t().to(self.stacked_bt)
            self.slot_scaling[slot] = scaling

    def slot_bytes(self) -> int:
        rank = self.adapters.rank
        return rank * (self.in_features + self.out_features) * self.stacked_a.element_size()


def install_row_lora(model: nn.Module, slots: int, rank: int) -> tuple[RowAdapters, dict[str, RowLoRALinear]]:
    """Replace every package `LoRALinear` of `model` (built with a LoRA config of this rank) by a
    `RowLoRALinear` with `slots` adapter slots. Returns the shared row selection and the new
    layers by the package's module name (its adapter files' keys are NAME.lora_A, NAME.lora_B)."""
    from voxcpm.modules.layers.lora import LoRALinear

    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    if not targets:
        raise ValueError("the model has no LoRA layers: build it with a LoRA config")
    first = targets[0][1]
    adapters = RowAdapters(slots, rank, first.lora_A.device, first.lora_A.dtype)
    layers: dict[str, RowLoRALinear] = {}
    for name, module in targets:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = RowLoRALinear(module, adapters)
        setattr(parent, attribute, layer)
        layers[name] = layer
    return adapters, layers
