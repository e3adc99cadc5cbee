"""The whole decode step as one function of static per-slot buffers: one graph for every bucket.

A step's pieces compiled apart (`compiled.py`: the CFM's velocity, the advance, the decode)
leave the Euler loop, the state's gathers and scatters and the noise in Python: some 200
operations a step outside the graphs, each a kernel launch on a GPU. Here the whole step is
one pure function of

- the model, and the VAE's streaming decoder (its convolutions read their carried state);
- `caches`: every layer's K and V, base LM then residual LM (`SlotKV.k` / `.v`), one flat list;
- `buffers`: the per-slot state (`SlotState`: LM hidden, residual hidden, condition, cfg) and
  the VAE's carried state per convolution (`BatchedStreamingVAE.states`), one flat list;
- `rows`: int64 [bucket, 3], each row's slot, position and noise key (`noise.row_key`): the
  one host-to-device copy a step makes;
- `keys_at`: the key positions the step attends over (its length the one dynamic size);

with the number of CFM timesteps, whether it decodes and how it attends fixed per graph
(`step_function`: in place, FlexAttention over the caches as they are, where this device's
compiler has its kernel and it compiles, `attention_choice.choose_attention`; else through the
gather, as an uncompiled step always does: `kv.lm_step`). It reads each row's state by slot,
draws its noise, solves, advances both LMs, decodes, writes the new state back by slot, and
returns (stop flags, patches, audio): compiled with `fullgraph=True` it is one graph (no break,
no host sync), which a CUDA device replays as one CUDA graph (`cuda_graphs.py`). Padding rows (a
bucket's extra rows) sit in the padding slot.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from .compiled import advance, cfm_solve
from .noise import draw, element_hashes
from .vae import streaming_decode

# The state buffers before the VAE's, in `buffers`' order.
SLOT_BUFFERS = 4


def step_function(timesteps: int, decode: bool, in_place: bool = False) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The whole step for `timesteps` CFM steps, decoding its patches where `decode` (else its
    patches go to a decoder process), attending `in_place` or through the gather (`kv.lm_step`):
    (model, decoder, caches, buffers, rows, keys_at) -> (stop [b], patches [b, P, D]) and,
    decoding, audio [b, samples] float32."""

    def whole_step(model: nn.Module, decoder: Any, caches: list[torch.Tensor], buffers: list[torch.Tensor],
                   rows: torch.Tensor, keys_at: torch.Tensor) -> tuple[torch.Tensor, ...]:
        base_layers = len(model.base_lm.layers)
        residual_layers = len(model.residual_lm.layers)
        base_k, base_v = caches[:base_layers], caches[base_layers:2 * base_layers]
        residual_k = caches[2 * base_layers:2 * base_layers + residual_layers]
        residual_v = caches[2 * base_layers + residual_layers:]
        lm_state, residual_state, cond_state, cfg_state = buffers[:SLOT_BUFFERS]
        slots, positions, keys = rows[:, 0], rows[:, 1], rows[:, 2]

        lm_hidden = lm_state.index_select(0, slots)
        residual_hidden = residual_state.index_select(0, slots)
        cond = cond_state.index_select(0, slots)                                # [b, P, D]
        cfg = cfg_state.index_select(0, slots)
        mu = torch.cat((model.lm_to_dit_proj(lm_hidden), model.res_to_dit_proj(residual_hidden)), dim=-1)
        shape = (model.feat_dim, model.patch_size)
        noise = draw(keys, element_hashes(shape[0] * shape[1], rows.device), shape, lm_hidden.dtype)
        patches = cfm_solve(model.feat_decoder, mu, cond.transpose(1, 2).contiguous(), noise, timesteps,
                            cfg).transpose(1, 2)
        stop, lm_next, residual_next = advance(model, base_k, base_v, residual_k, residual_v, patches, lm_hidden,
                                               slots, positions, keys_at, rows if in_place else None)
        lm_state.index_copy_(0, slots, lm_next)
        residual_state.index_copy_(0, slots, residual_next)
        cond_state.index_copy_(0, slots, patches)
        if not decode:
            return stop, patches
        vae_states = buffers[SLOT_BUFFERS:]
        carried = tuple(state.index_select(0, slots) for state in vae_states)
        audio, carried = streaming_decode(decoder, decoder.vae, patches.transpose(1, 2).to(vae_states[0].dtype),
                                          carried)
        for state, new in zip(vae_states, carried):
            state.index_copy_(0, slots, new)
        return stop, patches, audio.to(torch.float32)

    whole_step.__qualname__ = whole_step.__name__ = f"whole_step_t{timesteps}_{'decode' if decode else 'generate'}"
    return whole_step


def graph_name(timesteps: int, decode: bool) -> str:
    """The store's name of the whole step for `timesteps`, decoding or not."""
    return f"step_t{timesteps}_{'decode' if decode else 'generate'}"


class StepInputs(NamedTuple):
    """What a whole step reads and writes besides the model (`step_function`'s arguments)."""

    decoder: Any                   # vae.BatchedStreamingVAE
    caches: list[torch.Tensor]
    buffers: list[torch.Tensor]
    rows: torch.Tensor             # int64 [bucket, 3]: slot, position, noise key
    keys_at: torch.Tensor


def graph_context(model: nn.Module, decoder: Any, in_place: bool = False) -> str:
    """What a whole step's graph depends on besides its arguments' shapes and the model's
    modules (which the store's key covers): the model's config, the VAE's class, settings and
    modules (the decoder is no module: its VAE's shapes are named here), and how it attends."""
    from .graphs import module_signature
    from .kv import attention_name

    return "\n".join([model.config.model_dump_json(), decoder.graph_context(), module_signature(decoder.vae),
                      f"attention {attention_name(in_place)}"])


# The timesteps whose whole step is compiled ahead: the package's default. Other timesteps
# run the step's pieces (`compiled.CompiledStep`) or eager.
WHOLE_TIMESTEPS = (10,)


def symbolic_sizes(decode: bool, decoder: Any, in_place: bool) -> dict[str, int]:
    """The whole step's symbolic sizes: the slot counts and the attention length, and the batch
    (`GraphsBySize`: one graph for every bucket from 2) only where it attends through the gather
    and does not decode through a VAE whose depthwise convolutions are folded into one row (a
    CPU's: their groups grow with the batch, which would be specialised). Attending in place,
    a graph per bucket on every device: inductor lowers FlexAttention on a GPU to its decoding
    kernel only with a static batch (`flex_kernels.py`; with a symbolic one each row's one query
    is padded to a block of 128, slower than the gather it replaces), and a CPU's kernel does not
    compile with a symbolic batch (torch 2.13, measured)."""
    sizes = {"caches": 0, "buffers": 0, "keys_at": 0}
    per_bucket = (decode and getattr(decoder, "fold_depthwise", False)) or in_place
    return sizes if per_bucket else {**sizes, "rows": 0}


class WholeSteps:
    """The whole step's graphs from `store`, per (timesteps, decode): one per bucket where it
    attends in place (FlexAttention's decoding kernel wants a static batch) or decodes through a
    VAE whose depthwise convolutions are folded into one row (a CPU's: their groups grow with the
    batch); else one for a bucket of 1 and one with a symbolic batch for every other bucket
    (`GraphsBySize`, `symbolic_sizes`: the same speed as a graph per bucket on this CPU, a
    fraction of the compiling: docs/PERFORMANCE.md, `benchmarks/dynamic_batch.py`). Captured per
    bucket all the same (`cuda_graphs.py`). A step of rows whose bucket is `ready` runs through
    them. Made ahead by `warm_up`, never on a live step."""

    def __init__(self, store: Any, model: nn.Module, decoder: Any, buckets: tuple[int, ...],
                 in_place: bool | None = None) -> None:
        """`in_place`: how the graphs attend (default: `attention_choice.choose_attention` for the
        model's device, as `compiled.CompiledStep` chooses)."""
        from .attention_choice import choose_attention
        from .graphs import GraphsBySize

        self.model, self.decoder = model, decoder
        self.buckets = tuple(sorted(buckets))
        device = next(model.parameters()).device
        self.in_place = (choose_attention(device, (model.base_lm, model.residual_lm)).in_place if in_place is None
                         else in_place)
        context = graph_context(model, decoder, self.in_place)
        self._graphs = {
            (timesteps, decode): GraphsBySize(store, graph_name(timesteps, decode),
                                              step_function(timesteps, decode, self.in_place),
                                              context=context, rows_of="rows",
                                              dynamic=symbolic_sizes(decode, decoder, self.in_place))
            for timesteps in WHOLE_TIMESTEPS for decode in (False, True)}
        self.ready: set[tuple[int, int, bool]] = set()      # (bucket, timesteps, decode)
        self.compile_s: dict[str, float] = {}

    def serves(self, bucket: int, timesteps: int, decode: bool) -> bool:
        return (bucket, timesteps, decode) in self.ready

    def __call__(self, timesteps: int, decode: bool, given: StepInputs) -> tuple[torch.Tensor, ...]:
        return self._graphs[(timesteps, decode)](self.model, *given)

    def attention_kernels(self, timesteps: int, decode: bool, given: StepInputs) -> list[str]:
        """The FlexAttention kernel each attention of the graph serving `given`'s bucket takes on a
        CUDA device (`flex_kernels.kernels_of`, asked of its shapes: traced, not compiled, not run);
        [] where it attends through the gather."""
        from .flex_kernels import kernels_of

        graphs = self._graphs[(timesteps, decode)]
        return kernels_of(graphs.fn, (self.model, *given), graphs.dynamic_for(given.rows.shape[0]))

    def warm_up(self, given_for: Callable[[int], StepInputs], decode: bool, buckets: tuple[int, ...] | None = None
                ) -> None:
        """Compile (or load) every bucket's graph now, each run once on `given_for(bucket)`
        (padding rows: it writes only the padding slot), and mark it ready."""
        import time

        for timesteps in WHOLE_TIMESTEPS:
            for bucket in buckets or self.buckets:
                started = time.perf_counter()
                with torch.inference_mode():
                    self(timesteps, decode, given_for(bucket))
                self.compile_s[f"{bucket}x{timesteps}{'' if decode else ' generate'}"] = round(
                    time.perf_counter() - started, 1)
                self.ready.add((bucket, timesteps, decode))


class EagerWholeSteps:
    """The whole step uncompiled, for `buckets`: what a CUDA graph can capture with no compile
    at all (the device check times it; `WholeSteps` is the compiled one). It attends through the
    gather: FlexAttention uncompiled would materialise the scores over every slot."""

    def __init__(self, model: nn.Module, buckets: tuple[int, ...]) -> None:
        self.model = model
        self.buckets = tuple(sorted(buckets))
        self.in_place = False

    def serves(self, bucket: int, timesteps: int, decode: bool) -> bool:
        return bucket in self.buckets and timesteps in WHOLE_TIMESTEPS

    def __call__(self, timesteps: int, decode: bool, given: StepInputs) -> tuple[torch.Tensor, ...]:
        return step_function(timesteps, decode)(self.model, *given)
