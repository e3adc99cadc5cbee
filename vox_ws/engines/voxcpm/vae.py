"""The VAE's causal streaming decode for a batch of independent streams.

The package keeps a stream's decoder state in patched module forwards, one stream at a time.
Here each request carries its own state and any set of requests decodes in one call; the same
class runs in the engine thread and in the decoder process (`decoder_main`).
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Warming the VAE up for more rows stops once one decode takes this long.
WARM_UP_ENOUGH_S = 0.5


class BatchedStreamingVAE:
    """The package's stateful causal streaming decode, for a batch of independent streams.

    Each request keeps its own carried state (a dict: convolution index -> last input samples;
    indices, unlike module ids, mean the same in the decoder process).
    For one call the states are stacked along the batch dimension; afterwards they are split
    back. The convolutions' forwards are replaced once by ones that read the carried state
    from a thread-local context: outside a `decode` call (and in any other thread) they behave
    exactly as before, so the package's own decode paths are untouched.
    """

    def __init__(self, vae: nn.Module, rows_per_call: int | None = None, fold_depthwise: bool = False) -> None:
        from voxcpm.modules.audiovae.audio_vae_v2 import CausalConv1d, CausalTransposeConv1d

        self.vae = vae
        self.rows_per_call = rows_per_call   # None: every row in one call
        self.fold_depthwise = fold_depthwise
        self._local = threading.local()
        self._convs: list[tuple[nn.Module, int]] = []   # (module, context samples)
        for mod in vae.decoder.modules():
            if isinstance(mod, CausalConv1d):
                pad = mod._CausalConv1d__padding * 2 - mod._CausalConv1d__output_padding
                if pad > 0:
                    mod.forward = self._conv_forward(mod, len(self._convs), pad)
                    self._convs.append((mod, pad))
            elif isinstance(mod, CausalTransposeConv1d):
                trim = mod._CausalTransposeConv1d__padding * 2 - mod._CausalTransposeConv1d__output_padding
                ctx = (mod.kernel_size[0] - 1) // mod.stride[0]
                if ctx > 0:
                    mod.forward = self._transpose_forward(mod, len(self._convs), ctx, trim)
                    self._convs.append((mod, ctx))

    @torch.inference_mode()
    def warm_up(self, patch_size: int, max_rows: int) -> None:
        """Decode silence once for every row count up to `max_rows` (or `rows_per_call`): on a CPU
        the first call with a new batch shape builds its convolution kernels (30-40 ms each for
        the tiny model), which must not land on a live stream."""
        params = next(self.vae.parameters())
        for rows in range(1, min(max_rows, self.rows_per_call or max_rows) + 1):
            latents = torch.zeros(rows, self.vae.latent_dim, patch_size, device=params.device, dtype=params.dtype)
            started = time.perf_counter()
            self.decode(latents, [{} for _ in range(rows)])
            if time.perf_counter() - started > WARM_UP_ENOUGH_S:
                break   # decodes this slow (a real-size VAE on a CPU) dwarf a kernel build

    def decode(self, latents: torch.Tensor, states: list[dict[int, torch.Tensor]]) -> torch.Tensor:
        """latents [B, D, P] -> audio [B, samples]; updates each request's state in place."""
        step = self.rows_per_call
        if step and latents.shape[0] > step:
            return torch.cat([self._decode(latents[i:i + step], states[i:i + step])
                              for i in range(0, latents.shape[0], step)])
        return self._decode(latents, states)

    def _decode(self, latents: torch.Tensor, states: list[dict[int, torch.Tensor]]) -> torch.Tensor:
        batch: dict[int, torch.Tensor] = {}
        for key, (mod, ctx) in enumerate(self._convs):
            rows = [s.get(key) for s in states]
            if any(r is not None for r in rows):
                zeros = torch.zeros(1, mod.in_channels, ctx, device=latents.device, dtype=latents.dtype)
                batch[key] = torch.cat([r if r is not None else zeros for r in rows], dim=0)
        self._local.batch = batch
        try:
            audio = self.vae.decode(latents)
        finally:
            self._local.batch = None
        for key, stacked in batch.items():
            for row, state in enumerate(states):
                state[key] = stacked[row:row + 1]
        return audio.squeeze(1)

    def _conv_forward(self, mod: nn.Module, key: int, pad: int):
        # Causal convolution: carry the last `pad` input samples.
        depthwise = mod.groups == mod.in_channels == mod.out_channels and mod.groups > 1
        conv = _DepthwiseAsOneRow(mod) if depthwise and self.fold_depthwise else partial(nn.Conv1d.forward, mod)
        return self._stateful(mod, key, pad, lambda x, x_pad: (x_pad[:, :, -pad:], conv(x_pad)))

    def _transpose_forward(self, mod: nn.Module, key: int, ctx: int, trim: int):
        # Causal transposed convolution: carry `ctx` input samples, drop what they re-produce.
        left = ctx * mod.stride[0]

        def run(x: torch.Tensor, x_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = nn.ConvTranspose1d.forward(mod, x_full)
            return x[:, :, -ctx:], (out[..., left:-trim] if trim > 0 else out[..., left:])
        return self._stateful(mod, key, ctx, run)

    def _stateful(self, mod: nn.Module, key: int, ctx: int, run):
        """A forward that prepends the carried input (zeros at a stream's start) and lets `run`
        return the next carried input and the output; outside `decode`, the plain forward."""
        local, plain = self._local, type(mod).forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            batch = getattr(local, "batch", None)
            if batch is None:
                return plain(mod, x)
            carried = batch.get(key)
            x_full = torch.cat([carried, x], dim=-1) if carried is not None else F.pad(x, (ctx, 0))
            state, out = run(x, x_full)
            batch[key] = state.detach()
            return out
        return forward


class _DepthwiseAsOneRow:
    """A depthwise convolution over B rows run as one row of B x C channels.

    Same arithmetic, another kernel: oneDNN's depthwise kernel is slow on CPUs for batches of
    few-channel rows (B=8, 1 channel x 7686 samples: 400 us, as one row of 8 channels: 150 us),
    and those are the VAE's last, highest-rate layers."""

    def __init__(self, mod: nn.Conv1d) -> None:
        self.mod = mod
        self._repeated: tuple[Any, torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mod, rows = self.mod, x.shape[0]
        if rows == 1:
            return nn.Conv1d.forward(mod, x)
        # The weights repeated per row, kept while the weights and the row count stay the same.
        key = (rows, mod.weight.data_ptr(), mod.weight._version)
        if self._repeated is None or self._repeated[0] != key:
            bias = mod.bias.repeat(rows) if mod.bias is not None else None
            self._repeated = (key, mod.weight.repeat(rows, 1, 1), bias)
        _, weight, bias = self._repeated
        out = F.conv1d(x.reshape(1, rows * mod.in_channels, x.shape[-1]), weight, bias, mod.stride, mod.padding,
                       mod.dilation, mod.groups * rows)
        return out.view(rows, mod.out_channels, -1)



def fold_weight_norm(module: nn.Module) -> int:
    """Replace weight-normalised convolutions by plain ones holding the same weight.

    The VAE recomputes g * v / |v| for every convolution on every call; the result never
    changes at inference, so computing it once gives the same numbers for less work."""
    from torch.nn.utils import remove_weight_norm

    folded = 0
    for mod in module.modules():
        try:
            remove_weight_norm(mod)
            folded += 1
        except ValueError:
            pass   # not weight-normalised
    return folded

