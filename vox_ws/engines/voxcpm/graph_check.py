"""A compiled or loaded graph is compared with the eager code before it serves.

A saved graph keeps no guards (`graphs.py`), was traced on a small cache through whichever
attention kernel the compiling device took, and a graph loaded on another card or PyTorch
build may be wrong in ways no shape check sees: such a graph would speak wrong audio, silently.
So each bucket's pieces run on copies of the same state, eager and compiled, at several
attention lengths and slot counts, and are compared: the advance's stop flags, both hidden
states and every K and V it wrote; the CFM solve; the decode. A bucket that differs stays
eager, and the runner says so (`CompiledStep.mismatched`, `/v1/info`, the log).

The comparison touches only copies of its own (caches, inputs, carried state) and reads the
weights, so it runs where the graphs are loaded: a background compile's reader thread
(`CompiledStep.prepare`, `prepare_decode`), whose verdicts the thread that steps only records
and acts on (`runner.adopt`); with LoRA slots its calls take turns with the step's
(`RowAdapters.rows`), whose row selection they share.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any, Callable, Mapping, NamedTuple

import torch

from .kv import RowPlaces, SlotKV
from .lora import NO_ADAPTER

log = logging.getLogger("vox_ws.engines.voxcpm")

# The largest difference allowed, relative to the largest magnitude of what is compared:
# float32 round-off between kernels, and the mantissas of the half types.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 4e-2, torch.float16: 1e-2}
# KV slot counts the advance is compared at (the graphs take any number: a dynamic size).
SLOT_COUNTS = (2, 3)
# The CFM timesteps of the compared solve.
CHECK_TIMESTEPS = 4


def difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference of `got` from `want`, relative to `want`'s largest magnitude."""
    scale = want.abs().max().item() or 1.0
    return (got.float() - want.float()).abs().max().item() / scale


class Probe(NamedTuple):
    """The step compared, the eager step it is compared with, their model, random inputs of its
    device and dtype, and the difference allowed."""

    candidate: Any
    eager: Any
    model: Any
    randn: Callable[..., torch.Tensor]
    tolerance: float


def check_step(candidate: Any, eager: Any, model: Any, rows: int, seed: int = 0) -> str | None:
    """Why `candidate` (a `CompiledStep`) differs from `eager` (an `EagerStep`) for `rows` rows,
    or None where it agrees: the solve, and the advance at every slot count and at attention
    lengths from the shortest these rows can sit at to a few hundred positions."""
    params = next(model.parameters())
    device, dtype = params.device, params.dtype
    tolerance = TOLERANCE.get(dtype, 4e-2)
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    hidden = model.lm_to_dit_proj.out_features + model.res_to_dit_proj.out_features
    mu, cond = randn(rows, hidden), randn(rows, model.feat_dim, model.patch_size)
    noise = randn(rows, model.feat_dim, model.patch_size)
    cfg = (1.0 + 2.0 * torch.rand(rows, generator=generator)).to(device)
    adapters = [NO_ADAPTER] * rows
    with torch.inference_mode():
        want = eager.solve(mu, cond, noise, CHECK_TIMESTEPS, cfg, adapters)
        got = candidate.solve(mu, cond, noise, CHECK_TIMESTEPS, cfg, adapters)
    if difference(got, want) > tolerance:
        return f"the CFM solve for {rows} rows differs from eager by {difference(got, want):.2e}"
    for slots in SLOT_COUNTS:
        shortest = math.ceil(rows / slots) + 1
        for length in sorted({shortest, 2 * shortest + 7, min(257, model.config.max_length)}):
            if length <= model.config.max_length and length >= shortest:
                why = _check_advance(Probe(candidate, eager, model, randn, tolerance), rows, slots, length)
                if why is not None:
                    return why
    return None


def _check_advance(probe: Probe, rows: int, slots: int, length: int) -> str | None:
    """The advance of `rows` rows spread over `slots` slots (a slot's rows at distinct
    positions), the furthest at `length` - 1, on two copies of the same random caches."""
    candidate, eager, model, randn, tolerance = probe
    params = next(model.parameters())
    device, dtype = params.device, params.dtype
    caches = []
    for _ in range(2):
        base = SlotKV(model.base_lm, slots, model.config.max_length, device, dtype)
        residual = SlotKV(model.residual_lm, slots, model.config.max_length, device, dtype)
        caches.append((base, residual))
    # The positions attended over hold earlier keys and values; past them, zeros (never read).
    for layer_caches in zip(*(base.k + base.v + residual.k + residual.v for base, residual in caches)):
        slots_, heads, _, dim = layer_caches[0].shape
        filled = randn(slots_, heads, length, dim, scale=0.5)
        for cache in layer_caches:
            cache[:, :, :length] = filled
    slot_of = torch.tensor([i % slots for i in range(rows)], device=device)
    position_of = torch.tensor([length - 1 - i // slots for i in range(rows)], device=device)
    at = RowPlaces(slot_of, position_of, torch.arange(length, device=device))
    pred_feat, lm_hidden = randn(rows, model.patch_size, model.feat_dim), randn(rows, model.base_lm.config.hidden_size)
    with torch.inference_mode():
        want = eager.advance(*caches[0], pred_feat, lm_hidden, at, [NO_ADAPTER] * rows)
        got = candidate.advance(*caches[1], pred_feat, lm_hidden, at, [NO_ADAPTER] * rows)
    where = f"for {rows} rows in {slots} slots at {length} positions"
    if not torch.equal(got[0], want[0]):
        return f"the advance's stop flags {where} differ from eager"
    for name, a, b in (("LM hidden state", got[1], want[1]), ("residual hidden state", got[2], want[2])):
        if difference(a, b) > tolerance:
            return f"the advance's {name} {where} differs from eager by {difference(a, b):.2e}"
    (base_w, residual_w), (base_g, residual_g) = caches
    for name, written, wanted in (("K", base_g.k + residual_g.k, base_w.k + residual_w.k),
                                  ("V", base_g.v + residual_g.v, base_w.v + residual_w.v)):
        for layer, (a, b) in enumerate(zip(written, wanted)):
            # Only the real slots: the padding slot takes the padding rows' writes.
            if difference(a[:slots], b[:slots]) > tolerance:
                return f"the advance's written {name} (layer {layer}) {where} differs from eager"
    return None


def check_decode(decoder: Any, rows: int, patch_size: int, seed: int = 0, step: Any = None) -> str | None:
    """Why the compiled decode `step` (`decoder`'s own by default: `BatchedStreamingVAE`, compiled)
    differs from `decoder`'s eager decode for `rows` rows, on the same latents and carried
    state, or None. Both run on state of their own: the decoder's carried state is only read
    for its shapes."""
    from .vae import streaming_decode

    step = step or decoder._step
    generator = torch.Generator(device="cpu").manual_seed(seed)
    state = decoder.states[0]
    latents = torch.randn(rows, decoder.vae.latent_dim, patch_size, generator=generator).to(state.device, state.dtype)
    carried = tuple((torch.randn(rows, *s.shape[1:], generator=generator) * 0.1).to(s.device, s.dtype)
                    for s in decoder.states)
    with torch.inference_mode(), decoder._lock:
        want_audio, want_state = streaming_decode(decoder, decoder.vae, latents, tuple(c.clone() for c in carried))
        got_audio, got_state = step(latents, tuple(c.clone() for c in carried))
    tolerance = TOLERANCE.get(state.dtype, 4e-2)
    if difference(got_audio, want_audio) > tolerance:
        return f"the decode for {rows} rows differs from eager by {difference(got_audio, want_audio):.2e}"
    for key, (a, b) in enumerate(zip(got_state, want_state)):
        if difference(a, b) > tolerance:
            return f"the decode's carried state {key} for {rows} rows differs from eager"
    return None


def verdict(check: Callable[..., str | None], *args: Any) -> str | None:
    """`check(*args)` (`check_step`, `check_decode`): why the compiled piece differs from eager, or
    None; a comparison that fails is a difference too (the graph would fail or worse on a step)."""
    try:
        return check(*args)
    except Exception as exc:  # noqa: BLE001 - named where the mismatches are, never served
        return f"the comparison with eager failed ({type(exc).__name__}: {exc})"


def agreeing_buckets(compiled: Any, eager: Any, buckets: tuple[int, ...],
                     verdicts: Mapping[int | str, str | None] | None = None) -> tuple[int, ...]:
    """The buckets of `compiled` whose step agrees with `eager`; each other one is named in
    `compiled.mismatched` with why, and in the log: it stays eager. `verdicts`: the comparisons
    made already, off the thread that steps (`CompiledStep.prepare`); a bucket not there is
    compared now."""
    agreeing = []
    for rows in buckets:
        why = verdicts[rows] if verdicts is not None and rows in verdicts else verdict(
            check_step, compiled, eager, compiled.model, rows)
        if why is None:
            agreeing.append(rows)
            continue
        compiled.mismatched[rows] = why
        log.error("the compiled step for %d rows is not used: %s; those steps stay eager", rows, why)
    return tuple(agreeing)


def decode_mismatch(decoder: Any, patch_size: int, prepared: tuple[Any, tuple[int, ...]]) -> str | None:
    """Why a bucket of the compiled decode `prepared` holds (`BatchedStreamingVAE.prepare`:
    loaded, not yet in use) differs from `decoder`'s eager decode, or None where every one agrees."""
    graphs, buckets = prepared
    step = partial(graphs, decoder, decoder.vae)
    for rows in buckets:
        why = verdict(check_decode, decoder, rows, patch_size, 0, step)
        if why is not None:
            return why
    return None


def record_decode(why: str | None, mismatched: dict[int | str, str]) -> bool:
    """Whether the compiled decode agreed with eager (`why`: `decode_mismatch`'s); where it did
    not, it is named in `mismatched` (under "decode") and the log."""
    if why is None:
        return True
    mismatched["decode"] = why
    log.error("the compiled decode is not used: %s; the decode stays eager", why)
    return False


def check_whole_step(whole: Any, eager: Any, template: list[torch.Tensor], bucket: int, decode: bool
                     ) -> str | None:
    """Why the compiled whole step `whole` (`whole_step.WholeSteps`) for `bucket` rows differs
    from `eager`, the same step uncompiled (`EagerWholeSteps`, attending through the gather), or
    None: from two copies of the same random state (caches of `SLOT_COUNTS` slots, per-slot
    buffers shaped as `template`'s, the runner's), its outputs (stop flags, patches and,
    decoding, audio) and everything it wrote (K and V, the per-slot state, the VAE's carried
    state), at attention lengths that cross blocks, for each of its timesteps. Never the
    runner's own state: a bucket is checked on copies of its own."""
    model, decoder = whole.model, whole.decoder
    params = next(model.parameters())
    device, dtype = params.device, params.dtype
    tolerance = TOLERANCE.get(dtype, 4e-2)
    generator = torch.Generator(device="cpu").manual_seed(bucket)
    timesteps_ready = sorted(t for (b, t, d) in whole.ready if b == bucket and d == decode)
    for slots in SLOT_COUNTS:
        shortest = math.ceil(bucket / slots) + 1
        for length in sorted({shortest, max(shortest, min(257, model.config.max_length))}):
            for timesteps in timesteps_ready:
                want_state = _random_whole_state(model, template, slots, length, generator)
                got_state = tuple([t.clone() for t in part] for part in want_state)
                rows = torch.tensor([[i % slots, length - 1 - i // slots, 1000 + i] for i in range(bucket)],
                                    dtype=torch.long, device=device)
                keys_at = torch.arange(length, device=device)
                with torch.inference_mode():
                    want = eager(timesteps, decode, (decoder, *want_state, rows, keys_at))
                    got = whole(timesteps, decode, (decoder, *got_state, rows, keys_at))
                where = f"for {bucket} rows in {slots} slots at {length} positions"
                if not torch.equal(got[0], want[0]):
                    return f"the whole step's stop flags {where} differ from eager"
                for name, a, b in zip(("patches", "audio"), got[1:], want[1:]):
                    if difference(a, b) > tolerance:
                        return f"the whole step's {name} {where} differ from eager by {difference(a, b):.2e}"
                for name, written, wanted in zip(("K and V", "per-slot state"), got_state, want_state):
                    for a, b in zip(written, wanted):
                        # Only the real slots: the padding slot is never read.
                        if difference(a[:slots], b[:slots]) > tolerance:
                            return f"the whole step's written {name} {where} differs from eager"
    return None


def _random_whole_state(model: Any, template: list[torch.Tensor], slots: int, length: int,
                        generator: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A whole step's caches (`slots` KV slots, random K and V before `length`) and per-slot
    buffers shaped as `template`'s, random: on the model's device, none of the runner's."""
    params = next(model.parameters())
    device, dtype = params.device, params.dtype
    kv = [SlotKV(lm, slots, model.config.max_length, device, dtype) for lm in (model.base_lm, model.residual_lm)]
    caches = kv[0].k + kv[0].v + kv[1].k + kv[1].v
    for cache in caches:
        cache[:, :, :length] = (torch.randn(*cache[:, :, :length].shape, generator=generator) * 0.5).to(device, dtype)
    buffers = [torch.randn(slots + 1, *b.shape[1:], generator=generator).to(device, b.dtype)
               if b.is_floating_point() else b.new_zeros((slots + 1, *b.shape[1:])) for b in template]
    return caches, buffers


def agreeing_whole_steps(whole: Any, eager: Any, template: list[torch.Tensor], buckets: tuple[int, ...],
                         decode: bool, mismatched: dict[int | str, str]) -> None:
    """Leave every bucket of `whole` (`WholeSteps`, warmed up) whose step differs from `eager`
    (the uncompiled whole step) out of its `ready` buckets (its steps then run the pieces),
    named in `mismatched` (as "whole <rows>") and the log. Before anything is captured from it."""
    for rows in buckets:
        why = verdict(check_whole_step, whole, eager, template, rows, decode)
        if why is None:
            continue
        whole.ready -= {entry for entry in whole.ready if entry[0] == rows and entry[2] == decode}
        mismatched[f"whole {rows}"] = why
        log.error("the compiled whole step for %d rows is not used: %s; it runs the step's pieces", rows, why)
