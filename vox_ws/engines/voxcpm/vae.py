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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .graphs import GraphsBySize, GraphStore, bucket_of, padded

# Warming the VAE up for more rows stops once one decode takes this long.
WARM_UP_ENOUGH_S = 0.5


class BatchedStreamingVAE:
    """The package's stateful causal streaming decode, for a batch of independent streams.

    Each KV slot has its own carried state: per causal convolution, one tensor of every slot's
    last input samples ([slots + 1, channels, context]; the last slot is the padding rows').
    A call gathers its rows' states by slot index and scatters them back after, one indexed
    copy per convolution whatever the batch; `reset` zeroes a new stream's (what the package's
    causal left padding is). One decode is a pure function `(latents, carried) -> (audio,
    carried)`, which `compile` compiles per batch bucket.

    The convolutions' forwards are replaced once by ones that read the carried state from
    `self._carried` while a decode runs (decodes are serialised by a lock); outside a decode
    they behave exactly as before.
    """

    def __init__(self, vae: nn.Module, slots: int, rows_per_call: int | None = None,
                 fold_depthwise: bool = False) -> None:
        from voxcpm.modules.audiovae.audio_vae_v2 import CausalConv1d, CausalTransposeConv1d

        self.vae = vae
        self.rows_per_call = rows_per_call   # None: every row in one call
        self.fold_depthwise = fold_depthwise
        self._lock = threading.Lock()
        self._carried: dict[int, torch.Tensor] | None = None
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
        params = next(vae.parameters())
        _hold_sample_rate_condition(vae)
        self.padding_slot = slots
        self.states = [torch.zeros(slots + 1, mod.in_channels, ctx, device=params.device, dtype=params.dtype)
                       for mod, ctx in self._convs]
        self._step = self._decode_carried     # or its compiled form, per bucket
        self.buckets: tuple[int, ...] = ()    # compiled for these row counts; () eager
        self.compile_s: dict[int, float] = {}

    @torch.inference_mode()
    def warm_up(self, patch_size: int, max_rows: int) -> None:
        """Decode silence once for every row count up to `max_rows` (or `rows_per_call`): on a CPU
        the first call with a new batch shape builds its convolution kernels (30-40 ms each for
        the tiny model), which must not land on a live stream."""
        for rows in range(1, min(max_rows, self.rows_per_call or max_rows) + 1):
            started = time.perf_counter()
            self.decode(self._silence(rows, patch_size), self._padding_slots(rows))
            if time.perf_counter() - started > WARM_UP_ENOUGH_S:
                break   # decodes this slow (a real-size VAE on a CPU) dwarf a kernel build

    @torch.inference_mode()
    def compile(self, buckets: tuple[int, ...], patch_size: int, store: GraphStore) -> None:
        """From now on decode through graphs compiled per bucket (from `store`: loaded where they
        were compiled before), compiling every bucket now: the steps' `buckets`, where one call
        takes at most `rows_per_call` rows of them. A call is padded up to its bucket."""
        graphs, buckets = self._graphs(buckets, store)
        self._step = partial(graphs, self, self.vae)
        self.buckets = buckets
        for rows in self.buckets:
            started = time.perf_counter()
            self.decode(self._silence(rows, patch_size), self._padding_slots(rows))
            self.compile_s[rows] = round(time.perf_counter() - started, 1)

    def prepare(self, buckets: tuple[int, ...], patch_size: int, store: GraphStore) -> tuple[GraphsBySize, tuple]:
        """The compiled decode's graphs for `buckets` loaded from `store` and run once each, on
        state of their own, by a thread other than the one that decodes (a background compile's
        reader): loading them from the disk would stall every stream there. Only a run holds
        the decode's lock (the convolutions read this decoder's carried state), never a load.
        `switch_to` puts them in use."""
        graphs, buckets = self._graphs(buckets, store)
        for rows in buckets:
            latents = self._silence(rows, patch_size)
            carried = tuple(torch.zeros(rows, *state.shape[1:], device=state.device, dtype=state.dtype)
                            for state in self.states)
            graph = graphs.load(self, self.vae, latents, carried)
            started = time.perf_counter()
            with torch.inference_mode(), self._lock:
                try:
                    graph(self, self.vae, latents, carried)
                finally:
                    self._carried = None
            self.compile_s[rows] = round(time.perf_counter() - started, 1)
        return graphs, buckets

    def switch_to(self, prepared: tuple[GraphsBySize, tuple]) -> None:
        """Decode through graphs `prepare` loaded (on the thread that decodes, between two steps)."""
        graphs, buckets = prepared
        self._step = partial(graphs, self, self.vae)
        self.buckets = buckets

    def _graphs(self, buckets: tuple[int, ...], store: GraphStore) -> tuple[GraphsBySize, tuple]:
        """The decode's graphs from `store`, and the buckets a call takes: the steps' `buckets`,
        where one call takes at most `rows_per_call` rows of them."""
        if not buckets:
            raise ValueError("no batch sizes to compile the decode for")
        limit = self.rows_per_call
        if limit and max(buckets) > limit:
            buckets = tuple(b for b in buckets if b < limit) + (limit,)
        graphs = GraphsBySize(store, f"vae_decode_fold{int(self.fold_depthwise)}", streaming_decode,
                              context=self.graph_context(), rows_of="latents")
        return graphs, tuple(sorted(set(buckets)))

    def graph_context(self) -> str:
        """What a compiled decode depends on besides the VAE's modules: its class and its plain
        settings (the output sample rate becomes a constant of the graph). The same in the
        engine's process and the decoder process, so that either loads what the other compiled."""
        settings = {name: repr(value) for name, value in sorted(vars(self.vae).items())
                    if not name.startswith("_")
                    and (value is None or isinstance(value, (int, float, str, bool, list, tuple, np.number)))}
        return f"{type(self.vae).__module__}.{type(self.vae).__qualname__} {settings}"

    def _silence(self, rows: int, patch_size: int) -> torch.Tensor:
        params = next(self.vae.parameters())
        return torch.zeros(rows, self.vae.latent_dim, patch_size, device=params.device, dtype=params.dtype)

    def _padding_slots(self, rows: int) -> torch.Tensor:
        return torch.full((rows,), self.padding_slot, dtype=torch.long, device=self.states[0].device)

    def reset(self, slots: torch.Tensor) -> None:
        """New streams in these slots: their carried state is silence."""
        for state in self.states:
            state.index_fill_(0, slots, 0)

    def export_states(self, slots: torch.Tensor) -> list[np.ndarray]:
        """These slots' carried state, per convolution [rows, channels, context] (`import_states`
        takes it, in another process's decoder)."""
        return [state.index_select(0, slots).cpu().numpy() for state in self.states]

    def import_states(self, slots: torch.Tensor, states: list[np.ndarray]) -> None:
        """Streams that were decoded elsewhere go on here from the state they left there."""
        for state, given in zip(self.states, states):
            state.index_copy_(0, slots, torch.from_numpy(given).to(state.device, state.dtype))

    def decode(self, latents: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """latents [B, D, P] of the streams in `slots` (int64 [B]) -> audio [B, samples]; each
        slot's carried state goes on from there."""
        step = self.rows_per_call
        if step and latents.shape[0] > step:
            return torch.cat([self._decode(latents[i:i + step], slots[i:i + step])
                              for i in range(0, latents.shape[0], step)])
        return self._decode(latents, slots)

    def _decode(self, latents: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows = latents.shape[0]
        size = bucket_of(rows, self.buckets) or rows
        if size > rows:    # a compiled bucket's padding rows carry the padding slot's state
            slots = torch.cat([slots, self._padding_slots(size - rows)])
            latents = padded(latents, size)
        carried = tuple(state.index_select(0, slots) for state in self.states)
        with self._lock:
            try:
                audio, carried = self._step(latents.contiguous(), carried)
            finally:
                self._carried = None
        for state, stacked in zip(self.states, carried):
            state.index_copy_(0, slots, stacked)
        return audio if size == rows else audio[:rows]

    def _decode_carried(self, latents: torch.Tensor, carried: tuple[torch.Tensor, ...]
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return streaming_decode(self, self.vae, latents, carried)

    def _conv_forward(self, mod: nn.Module, key: int, pad: int):
        # Causal convolution: carry the last `pad` input samples.
        depthwise = mod.groups == mod.in_channels == mod.out_channels and mod.groups > 1
        conv = _DepthwiseAsOneRow(mod) if depthwise and self.fold_depthwise else partial(nn.Conv1d.forward, mod)
        return self._stateful(mod, key, lambda x, x_full: (x_full[:, :, -pad:], conv(x_full)))

    def _transpose_forward(self, mod: nn.Module, key: int, ctx: int, trim: int):
        # Causal transposed convolution: carry `ctx` input samples, drop what they re-produce.
        left = ctx * mod.stride[0]

        def run(x: torch.Tensor, x_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = nn.ConvTranspose1d.forward(mod, x_full)
            return x[:, :, -ctx:], (out[..., left:-trim] if trim > 0 else out[..., left:])
        return self._stateful(mod, key, run)

    def _stateful(self, mod: nn.Module, key: int, run):
        """A forward that prepends the carried input and lets `run` return the next carried input
        and the output; outside a decode, the plain forward."""
        plain = type(mod).forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            carried = self._carried
            if carried is None:
                return plain(mod, x)
            state, out = run(x, torch.cat([carried[key], x], dim=-1))
            carried[key] = state.detach()
            return out
        return forward


# The VAE's buffer holding its output sample rate as its decoder's condition takes it.
SAMPLE_RATE_CONDITION = "vox_ws_sample_rate_condition"


def _hold_sample_rate_condition(vae: nn.Module) -> None:
    """Keep the condition `vae.decode` builds in every call where given none (its output sample
    rate, `torch.tensor([rate], device=...)`: a blocking host-to-device copy at every decode, a
    full sync of a GPU, and illegal in a CUDA graph's capture) as a buffer of the VAE, made once,
    on its device: the same value the package builds. Not saved with its weights (the decoder
    process loads them by name), and none where the VAE takes no condition."""
    if getattr(vae, "sr_bin_boundaries", None) is None or hasattr(vae, SAMPLE_RATE_CONDITION):
        return
    device = next(vae.parameters()).device
    vae.register_buffer(SAMPLE_RATE_CONDITION, torch.tensor([vae.out_sample_rate], device=device, dtype=torch.int32),
                        persistent=False)


def streaming_decode(decoder: BatchedStreamingVAE, vae: nn.Module, latents: torch.Tensor,
                     carried: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One streaming decode as a pure function: audio [B, samples] and the next carried state
    (`vae` is `decoder.vae`, named so that a compiled graph's key covers its weights' shapes)."""
    decoder._carried = dict(enumerate(carried))
    audio = vae.decode(latents, getattr(vae, SAMPLE_RATE_CONDITION, None))
    out = tuple(decoder._carried[key] for key in range(len(carried)))
    decoder._carried = None
    return audio.squeeze(1), out


class _DepthwiseAsOneRow:
    """A depthwise convolution over B rows run as one row of B x C channels.

    Same arithmetic, another kernel: oneDNN's depthwise kernel is slow on CPUs for batches of
    few-channel rows (B=8, 1 channel x 7686 samples: 400 us, as one row of 8 channels: 150 us),
    and those are the VAE's last, highest-rate layers. Compiled, the same (17.5 -> 9.6 ms for a
    compiled decode of 8 rows of the tiny model, against 11.3 without it)."""

    def __init__(self, mod: nn.Conv1d) -> None:
        self.mod = mod
        self._repeated: tuple[Any, torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mod, rows = self.mod, x.shape[0]
        if rows == 1:
            return nn.Conv1d.forward(mod, x)
        weight, bias = self._weights(rows)
        out = F.conv1d(x.reshape(1, rows * mod.in_channels, x.shape[-1]), weight, bias, mod.stride, mod.padding,
                       mod.dilation, mod.groups * rows)
        return out.view(rows, mod.out_channels, -1)

    def _weights(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        mod = self.mod
        if torch.compiler.is_compiling():       # in a graph: repeated there (no Python-side cache)
            return mod.weight.repeat(rows, 1, 1), (mod.bias.repeat(rows) if mod.bias is not None else None)
        # Eager: the weights repeated per row, kept while the weights and the row count stay the same.
        key = (rows, mod.weight.data_ptr(), mod.weight._version)
        if self._repeated is None or self._repeated[0] != key:
            bias = mod.bias.repeat(rows) if mod.bias is not None else None
            self._repeated = (key, mod.weight.repeat(rows, 1, 1), bias)
        return self._repeated[1], self._repeated[2]



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

