"""A compiled, loaded or captured graph is compared with the eager code before it serves.

A saved graph keeps no guards (`graphs.py`), was traced on a small cache through whichever
attention kernel the compiling device took, and a graph loaded on another card or PyTorch
build may be wrong in ways no shape check sees: such a graph would speak wrong audio, silently.
So each bucket's pieces run on the same state as the eager step, at several attention lengths,
and are compared: the advance's stop flags, both hidden states and every K and V it wrote; the
CFM solve; the decode; the whole step's outputs and everything it wrote; a captured whole step's
replay. A bucket that differs stays eager (or uncaptured), and the runner says so
(`CompiledStep.mismatched`, `CapturedSteps.failed`, `/v1/info`, the log).

What is compared is what serves. The compiled side runs on the serving's own KV slots
(`Serving`): the whole key length a step attends over in place (FlexAttention's decoding kernel
splits the keys by the whole sequence's length: a cache of a few slots would try other splits),
written only in slots no request holds (`runner.check_slot`, one slot kept for the comparisons,
and at start the free ones); the eager side, which gathers each row's prefix and so sees no
other slot, on caches of its own of the checked length alone. No second copy of the serving's
cache: the reader thread's comparison allocates some hundred positions of one slot.

Stop flags (an argmax of two logits) agree where they are equal, or where the eager logits are
within the tolerance of a tie (`stops_agree`): a bfloat16 near-tie decides either way on either
kernel, and is no sign of a wrong graph.

The comparison of the pieces touches only the check slot and state of its own and reads the
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
# The longest attention length compared (it crosses a block of the in-place attention's mask).
CHECK_LENGTH = 257
# The CFM timesteps of the compared solve.
CHECK_TIMESTEPS = 4


class Serving(NamedTuple):
    """The serving's state a comparison runs the compiled side on (`runner.serving_state`): its
    KV slots, its per-slot buffers and its VAE decoder (whose carried state is in them), and the
    slots it may write (`slots`, the check slot first): never a request's."""

    base_kv: SlotKV
    residual_kv: SlotKV
    buffers: list[torch.Tensor]
    decoder: Any
    slots: tuple[int, ...]

    @property
    def caches(self) -> list[torch.Tensor]:
        return self.base_kv.k + self.base_kv.v + self.residual_kv.k + self.residual_kv.v


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


def stop_logits(model: Any, lm_hidden: torch.Tensor) -> torch.Tensor:
    """The stop head's logits for these LM states, as `compiled.advance` takes its argmax."""
    return model.stop_head(model.stop_actn(model.stop_proj(lm_hidden))).float()


def stops_agree(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, tolerance: float) -> bool:
    """Whether the stop flags `got` agree with `want` (eager's, from `logits`): equal, or where
    they differ, eager's two highest logits within `tolerance` (relative to the largest logit)
    of each other, a near-tie either kernel may decide either way."""
    differ = got.ne(want)
    if not bool(differ.any()):
        return True
    top = logits.topk(2, dim=-1).values
    margin = top[:, 0] - top[:, 1]
    scale = logits.abs().max().item() or 1.0
    return bool((margin[differ] <= tolerance * scale).all())


def check_step(candidate: Any, eager: Any, model: Any, rows: int, serving: Serving, seed: int = 0) -> str | None:
    """Why `candidate` (a `CompiledStep`) differs from `eager` (an `EagerStep`) for `rows` rows,
    or None where it agrees: the solve, and the advance, `candidate`'s on the serving's caches
    (its first writable slot, `serving.slots[0]`), at attention lengths from the shortest these
    rows can sit at to a few hundred positions."""
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
    # Every row in the one slot, each at a position of its own.
    shortest = rows + 1
    for length in sorted({shortest, 2 * shortest + 7, max(shortest, CHECK_LENGTH)}):
        if length <= model.config.max_length:
            why = _check_advance(Probe(candidate, eager, model, randn, tolerance), rows, length, serving)
            if why is not None:
                return why
    return None


def _seed_slots(serving_caches: list[torch.Tensor], own_caches: list[torch.Tensor], slots: tuple[int, ...],
                length: int, randn: Callable[..., torch.Tensor]) -> None:
    """The same random K and V before `length` in the serving's `slots` (zeroed first, whole) and
    in the own caches' slots 0.. (zeros past it)."""
    for theirs, mine in zip(serving_caches, own_caches):
        for own, slot in enumerate(slots):
            theirs[slot].zero_()
            filled = randn(*theirs.shape[1:2], length, theirs.shape[3], scale=0.5)
            theirs[slot, :, :length] = filled
            mine[own, :, :length] = filled


def _written_differ(serving_caches: list[torch.Tensor], own_caches: list[torch.Tensor], slots: tuple[int, ...],
                    tolerance: float) -> str | None:
    """Which K or V the compiled side wrote into the serving's `slots` differs from what eager
    wrote into its own slots 0.. (and past the own caches' positions, nothing may be written)."""
    for index, (theirs, mine) in enumerate(zip(serving_caches, own_caches)):
        held = mine.shape[2]
        for own, slot in enumerate(slots):
            beyond = theirs[slot, :, held:]
            if difference(theirs[slot, :, :held], mine[own]) > tolerance or bool(beyond.ne(0).any()):
                return f"K or V (cache {index} of {len(serving_caches)})"
    return None


def _check_advance(probe: Probe, rows: int, length: int, serving: Serving) -> str | None:
    """The advance of `rows` rows in one slot (the serving's first writable one for the
    candidate, a cache of its own of `length` positions for eager), each at a position of its
    own, the furthest at `length` - 1."""
    candidate, eager, model, randn, tolerance = probe
    params = next(model.parameters())
    device, dtype = params.device, params.dtype
    slot = serving.slots[0]
    mine = (SlotKV(model.base_lm, 1, length, device, dtype), SlotKV(model.residual_lm, 1, length, device, dtype))
    theirs = (serving.base_kv, serving.residual_kv)
    _seed_slots(_caches(*theirs), _caches(*mine), (slot,), length, randn)
    positions = torch.tensor([length - 1 - i for i in range(rows)], device=device)
    keys_at = torch.arange(length, device=device)
    pred_feat, lm_hidden = randn(rows, model.patch_size, model.feat_dim), randn(rows, model.base_lm.config.hidden_size)
    with torch.inference_mode():
        logits = stop_logits(model, lm_hidden)
        want = eager.advance(*mine, pred_feat, lm_hidden, RowPlaces(torch.zeros_like(positions), positions, keys_at),
                             [NO_ADAPTER] * rows)
        got = candidate.advance(*theirs, pred_feat, lm_hidden,
                                RowPlaces(torch.full_like(positions, slot), positions, keys_at), [NO_ADAPTER] * rows)
    where = f"for {rows} rows at {length} positions"
    if not stops_agree(got[0], want[0], logits, tolerance):
        return f"the advance's stop flags {where} differ from eager"
    for name, a, b in (("LM hidden state", got[1], want[1]), ("residual hidden state", got[2], want[2])):
        if difference(a, b) > tolerance:
            return f"the advance's {name} {where} differs from eager by {difference(a, b):.2e}"
    written = _written_differ(_caches(*theirs), _caches(*mine), (slot,), tolerance)
    if written is not None:
        return f"the advance's written {written} {where} differs from eager"
    return None


def _caches(base: SlotKV, residual: SlotKV) -> list[torch.Tensor]:
    return base.k + base.v + residual.k + residual.v


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


def agreeing_buckets(compiled: Any, eager: Any, buckets: tuple[int, ...], serving: Serving,
                     verdicts: Mapping[int | str, str | None] | None = None) -> tuple[int, ...]:
    """The buckets of `compiled` whose step agrees with `eager`; each other one is named in
    `compiled.mismatched` with why, and in the log: it stays eager. `verdicts`: the comparisons
    made already, off the thread that steps (`CompiledStep.prepare`); a bucket not there is
    compared now, on `serving`."""
    agreeing = []
    for rows in buckets:
        why = verdicts[rows] if verdicts is not None and rows in verdicts else verdict(
            check_step, compiled, eager, compiled.model, rows, serving)
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


class WholeCandidate(NamedTuple):
    """A whole step to compare with the uncompiled one: `step(timesteps, decode, inputs)` (a
    `WholeSteps`, or a captured graph's replay), the timesteps it serves, and the longest
    attention length its rows may sit at (a capture of the gathered step attends over its
    length only)."""

    step: Callable[..., tuple[torch.Tensor, ...]]
    timesteps: tuple[int, ...]
    longest: int = CHECK_LENGTH


def check_whole_step(candidate: WholeCandidate, eager: Any, serving: Serving, bucket: int, decode: bool
                     ) -> str | None:
    """Why the whole step `candidate` for `bucket` rows differs from `eager`, the same step
    uncompiled (`EagerWholeSteps`, attending through the gather), or None: from the same random
    state, the candidate's in the serving's writable slots (`serving.slots`: a row each while
    there are enough, else rows share them at positions of their own), eager's in state of its
    own of the checked length; its outputs (stop flags, patches and, decoding, audio) and
    everything it wrote (K and V, and the per-slot state of every slot holding one row), at
    attention lengths that cross blocks, for each of its timesteps."""
    model = eager.model
    max_len = model.config.max_length
    used = serving.slots[:min(bucket, len(serving.slots))]
    shortest = math.ceil(bucket / len(used)) + 1
    generator = torch.Generator(device="cpu").manual_seed(bucket)
    for length in sorted({shortest, max(shortest, min(candidate.longest, max_len))}):
        for timesteps in candidate.timesteps:
            why = _check_whole_once(candidate, eager, serving, (bucket, decode, timesteps, length), used, generator)
            if why is not None:
                return why
    return None


def _check_whole_once(candidate: WholeCandidate, eager: Any, serving: Serving, shape: tuple[int, bool, int, int],
                      used: tuple[int, ...], generator: torch.Generator) -> str | None:
    bucket, decode, timesteps, length = shape
    model = eager.model
    params = next(model.parameters())
    device, dtype = params.device, params.dtype
    tolerance = TOLERANCE.get(dtype, 4e-2)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * scale).to(device, dtype)

    count = len(used)
    own = [SlotKV(lm, count, length, device, dtype) for lm in (model.base_lm, model.residual_lm)]
    own_caches = _caches(*own)
    _seed_slots(serving.caches, own_caches, used, length, randn)
    own_buffers = [b.new_zeros((count + 1, *b.shape[1:])) for b in serving.buffers]
    for theirs, mine in zip(serving.buffers, own_buffers):
        if mine.is_floating_point():
            mine[:count] = torch.randn(count, *mine.shape[1:], generator=generator).to(device, mine.dtype)
        theirs[list(used)] = mine[:count]
    placed = [(i % count, length - 1 - i // count, 1000 + i) for i in range(bucket)]
    rows_own = torch.tensor(placed, dtype=torch.long, device=device)
    rows_theirs = torch.tensor([(used[slot], position, key) for slot, position, key in placed], dtype=torch.long,
                               device=device)
    keys_at = torch.arange(length, device=device)
    with torch.inference_mode():
        logits = stop_logits(model, own_buffers[0][rows_own[:, 0]])
        # (decoder, caches, buffers, rows, keys_at): `whole_step.StepInputs`.
        want = eager(timesteps, decode, (serving.decoder, own_caches, own_buffers, rows_own, keys_at))
        got = candidate.step(timesteps, decode, (serving.decoder, serving.caches, serving.buffers, rows_theirs,
                                                 keys_at))
    where = f"for {bucket} rows in {count} slots at {length} positions"
    if not stops_agree(got[0], want[0], logits, tolerance):
        return f"the whole step's stop flags {where} differ from eager"
    for name, a, b in zip(("patches", "audio"), got[1:], want[1:]):
        if difference(a, b) > tolerance:
            return f"the whole step's {name} {where} differ from eager by {difference(a, b):.2e}"
    written = _written_differ(serving.caches, own_caches, used, tolerance)
    if written is not None:
        return f"the whole step's written {written} {where} differs from eager"
    # The per-slot state of each slot one row wrote (where rows share a slot, which row's state
    # lands there is the order of their writes, not the step's result). A step that does not
    # decode leaves the VAE's state as both were given it.
    alone = [j for j in range(count) if sum(1 for slot, _, _ in placed if slot == j) == 1]
    for index, (theirs, mine) in enumerate(zip(serving.buffers, own_buffers)):
        for j in alone:
            if difference(theirs[used[j]], mine[j]) > tolerance:
                return f"the whole step's written per-slot state (buffer {index}) {where} differs from eager"
    return None


def agreeing_whole_steps(whole: Any, eager: Any, serving: Serving, buckets: tuple[int, ...], decode: bool,
                         mismatched: dict[int | str, str]) -> None:
    """Leave every bucket of `whole` (`WholeSteps`, warmed up) whose step differs from `eager`
    (the uncompiled whole step) out of its `ready` buckets (its steps then run the pieces),
    named in `mismatched` (as "whole <rows>") and the log. Before anything is captured from it."""
    for rows in buckets:
        timesteps = tuple(sorted(t for (b, t, d) in whole.ready if b == rows and d == decode))
        why = verdict(check_whole_step, WholeCandidate(whole, timesteps), eager, serving, rows, decode)
        if why is None:
            continue
        whole.ready -= {entry for entry in whole.ready if entry[0] == rows and entry[2] == decode}
        mismatched[f"whole {rows}"] = why
        log.error("the compiled whole step for %d rows is not used: %s; it runs the step's pieces", rows, why)


def replay_mismatch(captured: Any, eager: Any, serving: Serving) -> str | None:
    """Why the replay of `captured` (a `cuda_graphs.CapturedReplay`: a graph of the whole step,
    its static inputs, its replay) differs from `eager`, the uncompiled whole step, or None:
    `check_whole_step` on the serving's state, each check's rows copied into the graph's static
    ones (the rest of its inputs are the serving's state already). Before the graph serves."""
    def replayed(timesteps: int, decode: bool, given: tuple) -> tuple[torch.Tensor, ...]:
        captured.given.rows.copy_(given[3])
        return captured.replay()

    candidate = WholeCandidate(replayed, (captured.timesteps,), min(CHECK_LENGTH, captured.length))
    why = verdict(check_whole_step, candidate, eager, serving, captured.bucket, captured.decode)
    return None if why is None else f"its replay differs from the uncompiled step: {why}"
