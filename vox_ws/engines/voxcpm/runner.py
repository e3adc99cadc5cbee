"""A batched VoxCPM2 generation loop written over the model's own modules.

The voxcpm package generates one request at a time: its KV caches live on the modules with
batch 1, its stop test reads row 0, and its streaming VAE decoder keeps state in patched module
forwards. This runner keeps every piece of per-request state apart so that any set of requests,
admitted at different times, advances together:

- KV caches: one slot per request in per-layer tensors; each row has its own position and
  attends to its own prefix through a mask (`kv.lm_step`, in `compiled.advance`).
- CFM: one Euler solve per group of requests sharing `inference_timesteps`, each row with its
  own `cfg_value` and its own noise drawn from the request's generator (`compiled.cfm_solve`).
- Stop head, LocEnc, projections, both LMs' decode step: one batched call (`compiled.advance`,
  eager or compiled), whose stop flags are read back once, after the whole step is queued.
- VAE: the package's causal streaming decode, with each request's carried convolution state
  stacked into the batch for one call and split back after (`vae.BatchedStreamingVAE`); on a
  CPU it runs in the decoder process (`decoder_process.py`), overlapped with the next step.

Every formula mirrors `VoxCPM2Model._inference` and `UnifiedCFM`, so one request's audio equals
what the package produces alone for it (same weights, same noise); tests/test_voxcpm_equivalence.py
checks it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...engine import EndReason
from .compiled import CompiledStep, EagerStep, adapted
from .cuda_graphs import Capture, CapturedSteps, CudaCapture, length_buckets
from .decoder_process import DecoderProcess
from .decoding import DecodeBalance, RowDecoding  # noqa: F401 - DecodeBalance: the tests' handle on it
from .graph_check import (
    Serving,
    agreeing_buckets,
    agreeing_whole_steps,
    decode_mismatch,
    record_decode,
    replay_mismatch,
)
from .graphs import bucket_of
from .kv import RowPlaces, SlotKV, key_positions
from .lora import NO_ADAPTER, RowAdapters
from .noise import NoiseSource, row_key
from .positions import fits, max_steps
from .prompt import Prompt
from .transfer import host_to_device, to_device
from .vae import BatchedStreamingVAE, fold_weight_norm
from .whole_step import WHOLE_TIMESTEPS, EagerWholeSteps, StepInputs, WholeSteps

# Same sway-sampling and CFG-zero* settings as UnifiedCFM.forward's defaults.
# The padded positions one batched prefill call takes at most (rows x the longest prompt): the
# prompts admitted in one turn go in together, up to this, so a burst of arrivals costs the
# running streams a few calls, not one per newcomer; it bounds the call's activations.
PREFILL_TOKENS = 8192
# ... and at most this many times the positions its prompts really have.
PREFILL_PADDING = 1.25


@dataclass
class PrefillInput:
    """What one request's prefill needs: its prompt and its generation settings."""

    prompt: Prompt
    seed: int
    cfg_value: float
    timesteps: int
    min_len: int
    max_len: int
    adapter: int = NO_ADAPTER


@dataclass(eq=False)
class RowState:
    """One request's generation state between steps, on the host. Its tensors (hidden states,
    condition, guidance, the VAE's carried state, its KV) live in its slot of the runner's
    per-slot buffers (`SlotState`), read and written by slot index for every row at once."""

    slot: int
    position: int                  # next KV position (same for the base and residual LM)
    seed: int                      # its noise: `noise.row_key(seed, step)`
    timesteps: int
    min_len: int
    max_steps: int
    step: int = 0
    in_process: bool = False         # its VAE state is in the decoder process
    decoded_here: bool | None = None  # where patches after the first are decoded; None: not yet decided
    end_reason: EndReason | None = None    # generation has ended; the last audio may still be decoding
    patches: list[np.ndarray] | None = None     # generated latents [P, D], kept to continue from
    text: str = ""                              # the text these latents say
    pending: tuple[Future, int] | None = None   # (decode job, row in it) still in flight
    adapter: int = NO_ADAPTER                   # its LoRA adapter slot


class SlotState:
    """What a step reads and writes per row, one tensor per kind with a row per KV slot (and
    the padding slot last): the LMs' hidden states, the CFM's condition (the previous patch)
    and each row's guidance. Gathered and scattered by slot index: the same few operations
    whatever the batch, and static buffers a captured step can read and write."""

    def __init__(self, slots: int, hidden: int, patch: tuple[int, int], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.lm_hidden = torch.zeros(slots + 1, hidden, device=device, dtype=dtype)
        self.residual_hidden = torch.zeros(slots + 1, hidden, device=device, dtype=dtype)
        self.prefix_cond = torch.zeros(slots + 1, *patch, device=device, dtype=dtype)   # [P, D] a slot
        # float32 whatever the model's dtype, as the package's Python float is (`compiled.velocity`).
        self.cfg = torch.ones(slots + 1, device=device, dtype=torch.float32)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lm hidden, residual hidden, condition, cfg) of these slots' rows."""
        return (self.lm_hidden.index_select(0, slots), self.residual_hidden.index_select(0, slots),
                self.prefix_cond.index_select(0, slots), self.cfg.index_select(0, slots))

    def advanced(self, slots: torch.Tensor, lm_hidden: torch.Tensor, residual_hidden: torch.Tensor,
                 patch: torch.Tensor) -> None:
        """These slots' rows made `patch` and moved their LMs on. A row that ended writes too:
        what it leaves is never read (the next request in its slot is prefilled)."""
        self.lm_hidden.index_copy_(0, slots, lm_hidden)
        self.residual_hidden.index_copy_(0, slots, residual_hidden)
        self.prefix_cond.index_copy_(0, slots, patch)

    def prefilled(self, slots: torch.Tensor, lm_hidden: torch.Tensor, residual_hidden: torch.Tensor,
                  cond: torch.Tensor, cfg: torch.Tensor) -> None:
        self.advanced(slots, lm_hidden, residual_hidden, cond)
        self.cfg.index_copy_(0, slots, cfg)


class BatchedVoxCPM2:
    """Runs prefill per request and one batched generation step for any set of requests."""

    def __init__(self, model: Any, slots: int, decode_process: bool | None = None,
                 warm_rows: int | None = None, adapters: RowAdapters | None = None,
                 decoder: DecoderProcess | None = None) -> None:
        """`slots` KV slots; steps of up to `warm_rows` rows (default: every slot) are warmed up;
        `adapters`: the model's LoRA slots (`lora.install_row_lora`), where it has them;
        `decoder`: a decoder process to decode in (started ahead, or another runner's:
        `take_decoder`), else one is started here where `decode_process` (default: on a CPU
        with a core to spare, `wants_decode_process`). Eager until `compile`."""
        self.model = model
        self.adapters = adapters
        # The step's pieces: eager, or compiled for the buckets whose graphs are loaded (`_step_for`).
        self.eager = EagerStep(model, adapters)
        self.compiled: CompiledStep | None = None
        self.device = next(model.parameters()).device
        self.dtype = model._dtype()
        self.slots = slots
        self.max_len = model.config.max_length
        # One slot more than requests get: the comparisons' (`graph_check.Serving`), where a graph
        # is checked on the serving's caches, at the key length a step attends over, while
        # requests are served in the others. The padding slot after it.
        self.check_slot = slots
        self.base_kv = SlotKV(model.base_lm, slots + 1, self.max_len, self.device, self.dtype)
        self.residual_kv = SlotKV(model.residual_lm, slots + 1, self.max_len, self.device, self.dtype)
        self.state = SlotState(slots + 1, model.base_lm.config.hidden_size, (model.patch_size, model.feat_dim),
                               self.device, self.dtype)
        self.noise = NoiseSource((model.feat_dim, model.patch_size), self.device)
        fold_weight_norm(model.audio_vae)
        on_cpu = self.device.type == "cpu"
        # On a CPU, decoding more than ~8 rows in one call falls out of cache (B=16 took 54 ms
        # in one call, 32 ms in two); a GPU wants every row in one call.
        rows_per_call = 8 if on_cpu else None
        # The decoder process: the decode of step k runs there while this thread generates step
        # k+1 (each row's audio comes one step later, except its first patch, decoded here at
        # once). Given its VAE first: it warms up while this process does.
        if decoder is None and (wants_decode_process(self.device.type) if decode_process is None else decode_process):
            decoder = DecoderProcess(threads=torch.get_num_threads())
        if decoder is not None and not decoder.has_vae:
            vae = model.audio_vae
            decoder.load_vae(type(vae), getattr(model.config, "audio_vae_config", None), vae.state_dict(),
                             slots=slots, rows_per_call=rows_per_call, warm_up=(model.patch_size, warm_rows or slots))
        self.vae = BatchedStreamingVAE(model.audio_vae, slots + 1, rows_per_call=rows_per_call, fold_depthwise=on_cpu)
        if on_cpu:
            self.vae.warm_up(model.patch_size, warm_rows or slots)
        self.decoding = RowDecoding(self.vae, decoder)
        self.whole: WholeSteps | None = None     # the whole step's graphs, where compiled
        self.captured: CapturedSteps | None = None   # and their CUDA graphs, where captured
        self._thread = threading.get_ident()     # the engine's: the one thread that may capture
        # The whole step's static buffers, in its arguments' order (`whole_step.step_function`).
        self._caches = self.base_kv.k + self.base_kv.v + self.residual_kv.k + self.residual_kv.v
        self._buffers = [self.state.lm_hidden, self.state.residual_hidden, self.state.prefix_cond, self.state.cfg,
                         *self.vae.states]
        self._free_slots = list(range(slots))
        cfg = model.config.lm_config
        self.scale_emb = cfg.scale_emb if cfg.use_mup else 1.0
        self.samples_per_step = model.patch_size * model._decode_chunk_size

    @property
    def decodes_in_process(self) -> bool:
        """Whether a decoder process decodes beside this one (`decode_process`)."""
        return self.decoding.process is not None

    def wait_ready(self) -> None:
        """Block until the decoder process, if there is one, can take work."""
        if self.decoding.process is not None:
            self.decoding.process.wait_ready()

    def compile(self, compiled: CompiledStep) -> None:
        """Generate through `compiled` from now on, and decode through a compiled VAE here and in
        the decoder process, compiling every bucket of every piece now. The decoder process
        compiles the decode beside this thread's step; the two share the decode's graphs (the
        store compiles each once, and a process that wants one being compiled waits for it)."""
        if self.decoding.process is not None:
            self.decoding.process.compile(compiled.buckets, str(compiled.cache_dir), self.model.patch_size)
        # What a background compile's reader does off this thread, then what `adopt` does.
        serving = self.serving_state()
        compiled.prepare(compiled.buckets, self.eager, serving)
        compiled.ready.update(agreeing_buckets(compiled, self.eager, compiled.buckets, serving, compiled.verdicts))
        compiled.prepare_decode(self.vae)
        if record_decode(compiled.verdicts["decode"], compiled.mismatched):
            self.vae.switch_to(compiled.prepared_decode)
        if compiled.whole_step:
            self.compile_whole(compiled)
            if self.device.type == "cuda":
                self.capture_whole(CudaCapture(self.device))
        if self.decoding.process is not None:
            loaded, compiled_there = self.decoding.process.wait_compiled()
            compiled.store.loaded += loaded
            compiled.store.compiled += compiled_there
        self.compiled = compiled

    def compile_whole(self, compiled: CompiledStep, buckets: tuple[int, ...] | None = None) -> None:
        """The whole step's graphs (`whole_step.py`) for `buckets` (default: every one), from
        `compiled`'s store, each run once on the padding slot; steps of those buckets whose rows
        all take the compiled timesteps go through them from now on. Not with LoRA slots (their
        row map is chosen per step: the step's pieces serve them)."""
        if self.adapters is not None:
            return
        if self.whole is None:
            self.whole = WholeSteps(compiled.store, self.model, self.vae, compiled.buckets, in_place=compiled.in_place)
        # A length of 2, as no real step has less (`CompiledStep.warm_up`).
        decode = self.decoding.process is None
        self.whole.warm_up(lambda bucket: _padding_step(self, bucket, 2), decode=decode, buckets=buckets)
        # Each compared with the uncompiled whole step first: one that differs is never captured nor run.
        agreeing_whole_steps(self.whole, EagerWholeSteps(self.model, self.whole.buckets),
                             self.serving_state(free=True), buckets or self.whole.buckets, decode, compiled.mismatched)

    def capture_whole(self, capture: Capture, buckets: tuple[int, ...] | None = None) -> None:
        """The whole step's graphs captured (`cuda_graphs.py`) for `buckets` (default: every
        compiled one) at every attention length (at one, where it attends in place), on this
        runner's thread only; steps replay them from now on. A capture that fails leaves its
        bucket to the uncaptured step."""
        if self.whole is None:
            raise RuntimeError("the whole step is not compiled: nothing to capture")
        if self.captured is None:
            # Each capture's replay compared with the uncompiled step before it serves.
            self.captured = CapturedSteps(self.whole, self.device, capture, owner=self._thread,
                                          verify=lambda captured: replay_mismatch(
                                              captured, EagerWholeSteps(self.model, (captured.bucket,)),
                                              self.serving_state(free=True)))
        # A step attending in place reads the whole cache whatever its rows' positions (its mask
        # bounds the work): one capture a bucket; through the gather, one per attention length.
        lengths = (self.max_len,) if self.whole.in_place else length_buckets(self.max_len)
        decode = self.decoding.process is None
        # Only what serves: a bucket that differed from the uncompiled step is never captured.
        serving = tuple(b for b in buckets or self.whole.buckets if self.whole.serves(b, WHOLE_TIMESTEPS[0], decode))
        self.captured.capture_all(lambda bucket, length: _padding_step(self, bucket, length), serving, lengths,
                                  decode=decode)

    def serving_state(self, free: bool = False) -> Serving:
        """This runner's caches and per-slot state as a comparison checks a graph on them: writing
        the check slot, and with `free` the slots no request holds (on this runner's thread only,
        where no request can take one meanwhile)."""
        slots = (self.check_slot, *(self._free_slots if free else ()))
        return Serving(self.base_kv, self.residual_kv, self._buffers, self.vae, slots)

    def adopt(self, compiled: CompiledStep, buckets: tuple[int, ...] = (), decode: bool = False) -> None:
        """Take in what a background compile put in `compiled`'s cache (`compiled` only loads),
        between two steps: steps of these `buckets`' rows go through its graphs from now on (rows
        of other buckets stay eager); with `decode`, the decode too, here and in the decoder
        process (which loads them before its next decode)."""
        if buckets:
            # Loaded, run once and compared with the eager step off this thread already
            # (`CompiledStep.prepare`), or here now: one that differs never serves.
            unprepared = tuple(rows for rows in buckets if rows not in compiled.verdicts)
            if unprepared:
                compiled.warm_up(self.base_kv, self.residual_kv, unprepared, mark_ready=False)
            compiled.ready.update(agreeing_buckets(compiled, self.eager, buckets, self.serving_state(),
                                                   compiled.verdicts))
            self.compiled = compiled
        if decode:
            # Loaded, run once and compared with eager off this thread already
            # (`CompiledStep.prepare_decode`), or here now.
            prepared = compiled.prepared_decode
            if prepared is None:
                prepared = self.vae.prepare(compiled.buckets, self.model.patch_size, compiled.store)
            why = (compiled.verdicts["decode"] if "decode" in compiled.verdicts
                   else decode_mismatch(self.vae, self.model.patch_size, prepared))
            if not record_decode(why, compiled.mismatched):
                return
            self.vae.switch_to(prepared)
            if self.decoding.process is not None:
                self.decoding.process.compile(compiled.buckets, str(compiled.cache_dir), self.model.patch_size)

    def take_decoder(self) -> DecoderProcess | None:
        """This runner's decoder process, for another runner (`decoder`); this one no longer
        decodes there, and its `close` leaves it running. Every row must have been released."""
        decoder, self.decoding.process = self.decoding.process, None
        return decoder

    def close(self, deadline: float | None = None) -> None:
        """Stop the decoder process, if there is one (by `deadline`, `time.monotonic()`, if given)."""
        if self.decoding.process is not None:
            self.decoding.process.close(deadline)

    # ------------------------------------------------------------------ capacity

    max_steps = staticmethod(max_steps)

    def fits(self, positions: int, target_tokens: int, max_len: int) -> bool:
        """Whether a prompt and its longest generation fit a KV slot."""
        return fits(positions, target_tokens, max_len, self.max_len)

    # ------------------------------------------------------------------ prefill

    def prefill(self, given: PrefillInput) -> RowState:
        """One request's prompt into a free KV slot (`prefill_many` of one)."""
        (row,) = self.prefill_many([given])
        if isinstance(row, BaseException):
            raise row
        return row

    def prefill_many(self, inputs: list[PrefillInput]) -> list[RowState | BaseException]:
        """Every prompt of one turn into a free KV slot each, batched: prompts of different
        lengths right-padded into one call of each LM per group of up to `PREFILL_TOKENS` padded
        positions (causal attention: a position never sees the padding after it, so each row is
        what it would be alone). Per input, its row or what failed it; a group that fails is
        run again one prompt at a time, so one bad prompt fails only itself."""
        if len(inputs) > len(self._free_slots):
            raise RuntimeError(f"{len(inputs)} prompts, {len(self._free_slots)} free KV slots")
        results: list[RowState | BaseException | None] = [None] * len(inputs)
        for group in _prefill_groups([i.prompt.text_tokens.shape[0] for i in inputs], PREFILL_TOKENS):
            try:
                rows = self._prefill_group([inputs[i] for i in group])
            except Exception as exc:  # noqa: BLE001 - attributed below, one prompt at a time
                if len(group) == 1:
                    results[group[0]] = exc
                    continue
                rows = []
                for i in group:
                    try:
                        rows.extend(self._prefill_group([inputs[i]]))
                    except Exception as exc_alone:  # noqa: BLE001 - this prompt's own failure
                        rows.append(exc_alone)
            for i, row in zip(group, rows):
                results[i] = row
        return results

    @torch.inference_mode()
    def _prefill_group(self, inputs: list[PrefillInput]) -> list[RowState]:
        m = self.model
        lengths = [i.prompt.text_tokens.shape[0] for i in inputs]
        slots = self._free_slots[:len(inputs)]
        del self._free_slots[:len(inputs)]
        try:
            text = _ragged([i.prompt.text_tokens for i in inputs], self.device)
            text_mask = _ragged([i.prompt.text_mask for i in inputs], self.device)
            feat = _ragged([i.prompt.audio_feat for i in inputs], self.device).to(self.dtype)
            feat_mask = _ragged([i.prompt.audio_mask for i in inputs], self.device)

            encoder = getattr(m, "_feat_encoder_raw", m.feat_encoder)
            feat_embed = m.enc_to_lm_proj(encoder(feat))
            text_embed = m.base_lm.embed_tokens(text) * self.scale_emb
            combined = text_mask.unsqueeze(-1) * text_embed + feat_mask.unsqueeze(-1) * feat_embed

            with adapted(self.adapters, [i.adapter for i in inputs]):
                enc_outputs, kv = m.base_lm(inputs_embeds=combined, is_causal=True)
                enc_outputs = m.fsq_layer(enc_outputs) * feat_mask.unsqueeze(-1) + enc_outputs * text_mask.unsqueeze(-1)
                residual_in = m.fusion_concat_proj(
                    torch.cat((enc_outputs, feat_mask.unsqueeze(-1) * feat_embed), dim=-1))
                residual_out, residual_kv = m.residual_lm(inputs_embeds=residual_in, is_causal=True)
            # Every row's last prompt position and its slot, in one copy each way.
            placed = to_device(slots + [length - 1 for length in lengths], self.device)
            at_slots, last = placed[:len(inputs)], placed[len(inputs):]
            self.base_kv.fill(at_slots, kv)
            self.residual_kv.fill(at_slots, residual_kv)
            by_row = torch.arange(len(inputs), device=self.device)
            self.state.prefilled(at_slots, enc_outputs[by_row, last], residual_out[by_row, last], feat[by_row, last],
                                 to_device([i.cfg_value for i in inputs], self.device, torch.float32))
            self.vae.reset(at_slots)
        except BaseException:
            self._free_slots.extend(slots)
            self._free_slots.sort()
            raise
        return [RowState(slot=slot, position=length, seed=given.seed, timesteps=given.timesteps,
                         min_len=given.min_len, max_steps=max_steps(given.prompt.target_tokens, given.max_len),
                         adapter=given.adapter)
                for given, slot, length in zip(inputs, slots, lengths)]

    def release(self, row: RowState) -> None:
        # The slot's state stays where it is: the next request in it is prefilled (and its VAE
        # state reset, here, or brought into the decoder process) before it is read.
        if row.slot not in self._free_slots:
            self._free_slots.append(row.slot)
            self._free_slots.sort()

    # ------------------------------------------------------------------ one step

    def step(self, rows: list[RowState]) -> list[tuple[np.ndarray | None, EndReason | None]]:
        """Advance every row by one patch. Returns, per row, (audio [samples] float32 or None,
        end reason or None). A row reports its end reason only with its last audio.

        Without a decoder process every row gets this step's audio now. With one, a row's first
        patch is decoded here at once (first audio never waits for the pipeline) and its later
        patches in the decoder process while the next step is generated, their audio coming
        back with the next step; or here, if the balance keeps the row here.

        The device work is the same few operations whatever the number of rows: their inputs go
        over in one copy, their state is gathered and scattered by slot, their noise is one
        draw, and what the host needs back (the audio decoded here, the stop flags, the patches
        a continuation keeps) comes back in one copy."""
        generating = [r for r in rows if r.end_reason is None]
        earlier = {id(r): r.pending for r in rows if r.pending is not None}
        for row in rows:
            row.pending = None
        now = self._generate_and_decode(generating) if generating else {}
        audio = self.decoding.gather(rows, earlier, now, stepped=bool(generating))
        return [(chunk, row.end_reason if row.pending is None else None) for chunk, row in zip(audio, rows)]

    def _generate_and_decode(self, rows: list[RowState]) -> dict[int, np.ndarray]:
        """Generate a patch for every row and start its decode; the end of each row's generation
        decided; returns the audio decoded here, by row."""
        count = len(rows)
        here = self.decoding.here(rows)
        audio = None
        whole = self._whole_step(rows, decode=self.decoding.process is None)
        if whole is not None:
            slots, pred_feat, stop, *decoded = whole
            audio = decoded[0] if decoded else None
        else:
            slots, pred_feat, stop = self._generate(rows)
        if audio is None:
            audio = self.decoding.decode(rows, here, pred_feat.transpose(1, 2).to(torch.float32), slots)
        # The one copy back: this step's audio decoded here, the stop flags, and the patches a
        # continuation keeps (the host reads them apart, with no more device work).
        keep = any(row.patches is not None for row in rows)
        parts = [stop.to(torch.float32)]
        if audio is not None:
            parts.append(audio.reshape(-1))
        if keep:
            parts.append(pred_feat.reshape(-1).to(torch.float32))
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
        stops, at = host[:count], count
        now: dict[int, np.ndarray] = {}
        if audio is not None:
            decoded_here = host[at:at + audio.numel()].reshape(len(here), -1)
            at += audio.numel()
            for j, i in enumerate(here):
                now[id(rows[i])] = decoded_here[j]
        patches = host[at:].reshape(count, *pred_feat.shape[1:]) if keep else None
        for i, row in enumerate(rows):
            if row.step > row.min_len and stops[i] == 1:
                row.end_reason = EndReason.DONE
            elif row.step + 1 >= row.max_steps:
                row.end_reason = EndReason.MAX_LEN
            row.step += 1
            if row.patches is not None:
                row.patches.append(patches[i].copy())
            if row.end_reason is None:
                row.position += 1
        return now

    @torch.inference_mode()
    def _whole_step(self, rows: list[RowState], decode: bool) -> tuple[torch.Tensor, ...] | None:
        """The step through its whole-step graph (`whole_step.py`), where one is ready for these
        rows' bucket and timesteps: (slots, patches, stop flags[, audio]); else None."""
        whole, count = self.whole, len(rows)
        timesteps = rows[0].timesteps
        bucket = bucket_of(count, whole.buckets) if whole is not None else None
        if bucket is None or not whole.serves(bucket, timesteps, decode) or any(r.timesteps != timesteps for r in rows):
            return None
        # Padding rows sit in the padding slot, at position 0, with any noise.
        placed = [(r.slot, r.position, row_key(r.seed, r.step)) for r in rows]
        placed += [(self.base_kv.padding_slot, 0, 0)] * (bucket - count)
        placed_rows = to_device([v for row in placed for v in row], self.device).view(bucket, 3)
        positions = max(r.position for r in rows) + 1
        replayed = (self.captured.replay(bucket, positions, timesteps, decode, placed_rows)
                    if self.captured is not None else None)
        if replayed is not None:
            placed_rows, stop, patches, *audio = replayed
        else:
            given = StepInputs(self.vae, self._caches, self._buffers, placed_rows,
                               torch.arange(positions, device=self.device))
            stop, patches, *audio = whole(timesteps, decode, given)
        slots = placed_rows[:, 0]
        if bucket > count:
            slots, stop, patches, audio = slots[:count], stop[:count], patches[:count], [a[:count] for a in audio]
        return (slots, patches, stop, *audio)

    @torch.inference_mode()
    def _generate(self, rows: list[RowState]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One patch for every row: CFM, LocEnc, stop head, LM advance, each row's state written
        back into its slot. Returns (the rows' slots, the patches [B, P, D], the stop flags [B]:
        1 where the stop head says stop)."""
        m = self.model
        count = len(rows)
        # The step's small inputs in one copy: each row's slot, position and noise key.
        placed = to_device([r.slot for r in rows] + [r.position for r in rows]
                           + [row_key(r.seed, r.step) for r in rows], self.device)
        slots, positions, keys = placed[:count], placed[count:2 * count], placed[2 * count:]
        lm_hidden, residual_hidden, cond, cfg = self.state.gather(slots)
        dit_hidden = torch.cat((m.lm_to_dit_proj(lm_hidden), m.res_to_dit_proj(residual_hidden)), dim=-1)
        noise = self.noise(keys, self.dtype)                                   # [B, D, P]
        groups = _groups(rows, lambda r: r.timesteps)
        if len(groups) == 1:
            (timesteps, _), = groups
            # Contiguous, as the compiled advance takes it.
            pred_feat = self._step_for(count).solve(dit_hidden, cond.transpose(1, 2).contiguous(), noise, timesteps,
                                                    cfg, [r.adapter for r in rows]).transpose(1, 2).contiguous()
        else:   # rows asking for different numbers of timesteps: one solve each
            pred_feat = torch.empty_like(cond)
            for timesteps, index in groups:
                idx = to_device(index, self.device)
                solved = self._step_for(len(index)).solve(dit_hidden[idx], cond[idx].transpose(1, 2).contiguous(),
                                                          noise[idx], timesteps, cfg[idx],
                                                          [rows[i].adapter for i in index])
                pred_feat[idx] = solved.transpose(1, 2)                        # [b, P, D]

        # Every row advances, also one that ends here (what it writes in its slot is never read):
        # the step stays one call, and its stop flags are read back once, after it is queued.
        at = RowPlaces(slots, positions, key_positions([r.position for r in rows], self.device))
        stop, lm_next, residual_next = self._step_for(count).advance(
            self.base_kv, self.residual_kv, pred_feat, lm_hidden, at, [r.adapter for r in rows])
        self.state.advanced(slots, lm_next, residual_next, pred_feat)
        return slots, pred_feat, stop

    def _step_for(self, rows: int) -> EagerStep | CompiledStep:
        """The step's pieces for a call of `rows` rows: compiled where the graphs of their bucket
        are loaded, else eager."""
        compiled = self.compiled
        return compiled if compiled is not None and compiled.serves(rows) else self.eager


def _padding_step(runner: BatchedVoxCPM2, bucket: int, length: int) -> StepInputs:
    """A whole step's inputs of `bucket` padding rows (the padding slot, position 1, noise key 0)
    attending over `length` positions: what a warm-up or a capture runs on, writing only the
    padding slot."""
    rows = torch.tensor([[runner.base_kv.padding_slot, 1, 0]] * bucket, dtype=torch.long, device=runner.device)
    return StepInputs(runner.vae, runner._caches, runner._buffers, rows, torch.arange(length, device=runner.device))


def wants_decode_process(device_type: str) -> bool:
    """Whether a runner on this kind of device decodes in a decoder process: on a CPU with a
    core to spare. On a GPU the kernels are asynchronous already."""
    return device_type == "cpu" and _usable_cpus() >= 2


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):   # Linux: the CPUs this process may run on
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _prefill_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` in groups of similar length: a group's padded size (rows x the
    longest) stays within `budget` and within `PREFILL_PADDING` of its real positions (padding
    is computed like any position: on a compute-bound device, too much of it costs more than the
    calls it saves); a prompt longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        padded = (len(groups[-1]) + 1) * lengths[i] if groups else 0
        if groups and padded <= budget and padded <= PREFILL_PADDING * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def _groups(rows: list[RowState], key) -> list[tuple[Any, list[int]]]:
    groups: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(key(row), []).append(i)
    return list(groups.items())


def _ragged(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One [rows, longest, ...] tensor on `device`, each row zero-padded at its end (prompts of
    different lengths; built on the host, copied without blocking where the device is a GPU)."""
    if len(tensors) == 1:
        out = tensors[0].unsqueeze(0)
    else:
        longest = max(t.shape[0] for t in tensors)
        out = tensors[0].new_zeros((len(tensors), longest, *tensors[0].shape[1:]))
        for row, t in enumerate(tensors):
            out[row, :t.shape[0]] = t
    return host_to_device(out, device)
