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

import itertools
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ...engine import EndReason
from .decoder_process import DecoderProcess
from .compiled import CompiledStep, EagerStep, adapted
from .kv import RowPlaces, SlotKV, key_positions
from .lora import NO_ADAPTER, RowAdapters
from .prompt import Prompt
from .transfer import host_to_device, to_device
from .vae import BatchedStreamingVAE, fold_weight_norm

# Same sway-sampling and CFG-zero* settings as UnifiedCFM.forward's defaults.
# The package caps generation at this many steps per target-text token (+10).
STEPS_PER_TOKEN = 6.0
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
    """One request's generation state between steps."""

    slot: int
    position: int                  # next KV position (same for the base and residual LM)
    lm_hidden: torch.Tensor        # [H]
    residual_hidden: torch.Tensor  # [H]
    prefix_cond: torch.Tensor      # [P, D]: the previous patch, the CFM's condition
    generator: torch.Generator
    cfg_value: float
    timesteps: int
    min_len: int
    max_steps: int
    step: int = 0
    key: int = 0                     # the row's name in the decoder process
    vae_state: dict[int, torch.Tensor] | None = field(default_factory=dict)   # None: the decoder process has it
    decoded_here: bool | None = None  # where patches after the first are decoded; None: not yet decided
    end_reason: EndReason | None = None    # generation has ended; the last audio may still be decoding
    patches: list[torch.Tensor] | None = None   # generated latents, kept to continue from
    text: str = ""                              # the text these latents say
    pending: tuple[Future, int] | None = None   # (decode job, row in it) still in flight
    adapter: int = NO_ADAPTER                   # its LoRA adapter slot



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
        self.base_kv = SlotKV(model.base_lm, slots, self.max_len, self.device, self.dtype)
        self.residual_kv = SlotKV(model.residual_lm, slots, self.max_len, self.device, self.dtype)
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
        self._decoder = decoder
        self._balance = DecodeBalance()
        if decoder is not None and not decoder.has_vae:
            vae = model.audio_vae
            decoder.load_vae(type(vae), getattr(model.config, "audio_vae_config", None), vae.state_dict(),
                             rows_per_call=rows_per_call, warm_up=(model.patch_size, warm_rows or slots))
        self.vae = BatchedStreamingVAE(model.audio_vae, rows_per_call=rows_per_call, fold_depthwise=on_cpu)
        if on_cpu:
            self.vae.warm_up(model.patch_size, warm_rows or slots)
        self._free_slots = list(range(slots))
        self._row_keys = itertools.count(1)
        cfg = model.config.lm_config
        self.scale_emb = cfg.scale_emb if cfg.use_mup else 1.0
        self.samples_per_step = model.patch_size * model._decode_chunk_size

    @property
    def decodes_in_process(self) -> bool:
        """Whether a decoder process decodes beside this one (`decode_process`)."""
        return self._decoder is not None

    def wait_ready(self) -> None:
        """Block until the decoder process, if there is one, can take work."""
        if self._decoder is not None:
            self._decoder.wait_ready()

    def compile(self, compiled: CompiledStep) -> None:
        """Generate through `compiled` from now on, and decode through a compiled VAE here and in
        the decoder process, compiling every bucket of every piece now. The decoder process
        compiles the decode beside this thread's step; the two share the decode's graphs (the
        store compiles each once, and a process that wants one being compiled waits for it)."""
        if self._decoder is not None:
            self._decoder.compile(compiled.buckets, str(compiled.cache_dir), self.model.patch_size)
        compiled.warm_up(self.base_kv, self.residual_kv)
        self.vae.compile(compiled.buckets, self.model.patch_size, compiled.store)
        if self._decoder is not None:
            loaded, compiled_there = self._decoder.wait_compiled()
            compiled.store.loaded += loaded
            compiled.store.compiled += compiled_there
        self.compiled = compiled

    def adopt(self, compiled: CompiledStep, buckets: tuple[int, ...] = (), decode: bool = False) -> None:
        """Take in what a background compile put in `compiled`'s cache (`compiled` only loads),
        between two steps: steps of these `buckets`' rows go through its graphs from now on (rows
        of other buckets stay eager); with `decode`, the decode too, here and in the decoder
        process (which loads them before its next decode)."""
        if buckets:
            # Loaded and run once already off this thread (`CompiledStep.prepare`), or here now.
            unprepared = tuple(rows for rows in buckets if rows not in compiled.compile_s)
            if unprepared:
                compiled.warm_up(self.base_kv, self.residual_kv, unprepared)
            compiled.ready.update(buckets)
            self.compiled = compiled
        if decode:
            self.vae.compile(compiled.buckets, self.model.patch_size, compiled.store)
            if self._decoder is not None:
                self._decoder.compile(compiled.buckets, str(compiled.cache_dir), self.model.patch_size)

    def take_decoder(self) -> DecoderProcess | None:
        """This runner's decoder process, for another runner (`decoder`); this one no longer
        decodes there, and its `close` leaves it running. Every row must have been released."""
        decoder, self._decoder = self._decoder, None
        return decoder

    def close(self) -> None:
        """Stop the decoder process, if there is one."""
        if self._decoder is not None:
            self._decoder.close()

    # ------------------------------------------------------------------ capacity

    @staticmethod
    def max_steps(target_tokens: int, max_len: int) -> int:
        return min(int(target_tokens * STEPS_PER_TOKEN + 10), max_len)

    def fits(self, positions: int, target_tokens: int, max_len: int) -> bool:
        """Whether a prompt and its longest generation fit a KV slot."""
        return positions + self.max_steps(target_tokens, max_len) <= self.max_len

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
                residual_in = m.fusion_concat_proj(torch.cat((enc_outputs, feat_mask.unsqueeze(-1) * feat_embed), dim=-1))
                residual_out, residual_kv = m.residual_lm(inputs_embeds=residual_in, is_causal=True)
            for row, (slot, length) in enumerate(zip(slots, lengths)):
                self.base_kv.fill(slot, kv, row, length)
                self.residual_kv.fill(slot, residual_kv, row, length)
        except BaseException:
            self._free_slots.extend(slots)
            self._free_slots.sort()
            raise
        rows = []
        for row, (given, slot, length) in enumerate(zip(inputs, slots, lengths)):
            generator = torch.Generator(device=self.device)
            generator.manual_seed(given.seed)
            rows.append(RowState(
                slot=slot,
                key=next(self._row_keys),
                position=length,
                lm_hidden=enc_outputs[row, length - 1, :].clone(),
                residual_hidden=residual_out[row, length - 1, :].clone(),
                prefix_cond=feat[row, length - 1].clone(),
                generator=generator,
                cfg_value=given.cfg_value,
                timesteps=given.timesteps,
                min_len=given.min_len,
                max_steps=self.max_steps(given.prompt.target_tokens, given.max_len),
                adapter=given.adapter,
            ))
        return rows

    def release(self, row: RowState) -> None:
        if row.slot not in self._free_slots:
            self._free_slots.append(row.slot)
            self._free_slots.sort()
        if row.vae_state is None and self._decoder is not None:
            row.vae_state = {}
            self._decoder.forget([row.key])

    # ------------------------------------------------------------------ one step

    def step(self, rows: list[RowState]) -> list[tuple[torch.Tensor | None, EndReason | None]]:
        """Advance every row by one patch. Returns, per row, (audio [samples] float32 on CPU or
        None, end reason or None). A row reports its end reason only with its last audio.

        Without a decoder process every row gets this step's audio now. With one, a row's first
        patch is decoded here at once (first audio never waits for the pipeline) and its later
        patches in the decoder process while the next step is generated, their audio coming
        back with the next step; or here, if the balance keeps the row here."""
        generating = [r for r in rows if r.end_reason is None]
        earlier = {id(r): r.pending for r in rows if r.pending is not None}
        for row in rows:
            row.pending = None
        now = self._generate_and_decode(generating) if generating else {}
        return self._gather(rows, earlier, now, stepped=bool(generating))

    def _generate_and_decode(self, rows: list[RowState]) -> dict[int, tuple[torch.Tensor, int]]:
        """Generate a patch for every row and start its decode; returns the audio decoded here,
        by row: (batch audio, row in it)."""
        first = [r.step == 0 for r in rows]
        latents = self._generate(rows)
        here = [i for i, row in enumerate(rows) if first[i] or self._decodes_here(row)]
        there = [i for i in range(len(rows)) if i not in here]
        if there:
            # Rows new to the process take along the state their first patch left here.
            new_states = {rows[i].key: rows[i].vae_state for i in there if rows[i].vae_state is not None}
            job = self._decoder.submit(latents[there], [rows[i].key for i in there], new_states)
            for j, i in enumerate(there):
                rows[i].vae_state = None
                rows[i].pending = (job, j)
        now: dict[int, tuple[torch.Tensor, int]] = {}
        if here:
            with torch.inference_mode():
                audio = self.vae.decode(latents[here], [rows[i].vae_state for i in here]).cpu()
            for j, i in enumerate(here):
                now[id(rows[i])] = (audio, j)
        return now

    def _gather(self, rows: list[RowState], earlier: dict[int, tuple[Future, int]],
                now: dict[int, tuple[torch.Tensor, int]], stepped: bool) -> list[tuple[torch.Tensor | None, EndReason | None]]:
        """Each row's audio: what the decoder process made of its previous patch, then what was
        decoded here in this step."""
        results: list[tuple[torch.Tensor | None, EndReason | None]] = []
        waited, jobs = 0.0, {}
        for row in rows:
            parts = []
            if id(row) in earlier:
                job, j = earlier[id(row)]
                started = time.perf_counter()
                decoded = self._decoder.wait(job)
                waited += time.perf_counter() - started
                parts.append(torch.from_numpy(decoded[j]))
                jobs[id(job)] = (len(decoded), job.decode_s)
            if id(row) in now:
                audio, j = now[id(row)]
                parts.append(audio[j])
            audio = parts[0] if len(parts) == 1 else (torch.cat(parts) if parts else None)
            results.append((audio, row.end_reason if row.pending is None else None))
        for job_rows, job_seconds in jobs.values():
            self._balance.decoded_there(job_rows, job_seconds)
        if self._decoder is not None and stepped:
            self._balance.waited(waited)
        return results

    def _decodes_here(self, row: RowState) -> bool:
        """Where a row's audio is decoded after its first patch: in the decoder process, unless
        this thread has been idling on the decoder long enough to take the row on itself. A row
        stays where it is first put: its carried state lives there."""
        if self._decoder is None:
            return True
        if row.decoded_here is None:
            row.decoded_here = self._balance.take_one()
        return row.decoded_here

    @torch.inference_mode()
    def _generate(self, rows: list[RowState]) -> torch.Tensor:
        """One patch for every row: CFM, LocEnc, stop head, LM advance. Returns the latents
        [B, D, P] for the VAE and sets `end_reason` on rows whose generation ends here."""
        m = self.model
        lm_hidden = torch.stack([r.lm_hidden for r in rows])
        residual_hidden = torch.stack([r.residual_hidden for r in rows])
        cond = torch.stack([r.prefix_cond for r in rows])                     # [B, P, D]

        dit_hidden = torch.cat((m.lm_to_dit_proj(lm_hidden), m.res_to_dit_proj(residual_hidden)), dim=-1)
        pred_feat = torch.empty_like(cond)
        for timesteps, index in _groups(rows, lambda r: r.timesteps):
            idx = to_device(index, self.device)
            noise = torch.cat([
                torch.randn((1, m.feat_dim, m.patch_size), generator=rows[i].generator, device=self.device,
                            dtype=self.dtype) for i in index
            ])
            cfg = to_device([rows[i].cfg_value for i in index], self.device, torch.float32)
            solved = self._step_for(len(index)).solve(dit_hidden[idx], cond[idx].transpose(1, 2).contiguous(), noise,
                                                      timesteps, cfg, [rows[i].adapter for i in index])
            pred_feat[idx] = solved.transpose(1, 2)                            # [b, P, D]

        # Every row advances, also one that ends here (what it writes in its slot is never read):
        # the step stays one call, and its stop flags are read back once, after it is queued.
        positions = [r.position for r in rows]
        at = RowPlaces(to_device([r.slot for r in rows], self.device), to_device(positions, self.device),
                       key_positions(positions, self.device))
        stop, lm_next, residual_next = self._step_for(len(rows)).advance(
            self.base_kv, self.residual_kv, pred_feat, lm_hidden, at, [r.adapter for r in rows])
        latents = pred_feat.transpose(1, 2).to(torch.float32)                  # b d p  (t = 1)
        for i, (row, stops) in enumerate(zip(rows, stop.tolist())):
            if row.step > row.min_len and stops == 1:
                row.end_reason = EndReason.DONE
            elif row.step + 1 >= row.max_steps:
                row.end_reason = EndReason.MAX_LEN
            row.step += 1
            row.prefix_cond = pred_feat[i]
            if row.patches is not None:
                row.patches.append(pred_feat[i].detach().to("cpu", torch.float32))
            if row.end_reason is None:
                row.lm_hidden, row.residual_hidden = lm_next[i], residual_next[i]
                row.position += 1
        return latents

    def _step_for(self, rows: int) -> EagerStep | CompiledStep:
        """The step's pieces for a call of `rows` rows: compiled where the graphs of their bucket
        are loaded, else eager."""
        compiled = self.compiled
        return compiled if compiled is not None and compiled.serves(rows) else self.eager


class DecodeBalance:
    """When the decoder process is the slower side of a step, the engine thread waits on it; a
    row decoded here instead moves its share of the decode from one side of that wait to the
    other. Tracks moving averages of the wait per step and of the decoder's time per row."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.wait_s = 0.0
        self.row_s: float | None = None
        self._taken = 0.0

    def waited(self, seconds: float) -> None:
        self.wait_s += self.smoothing * (seconds - self.wait_s)
        self._taken = 0.0

    def decoded_there(self, rows: int, seconds: float) -> None:
        per_row = seconds / rows
        self.row_s = per_row if self.row_s is None else self.row_s + self.smoothing * (per_row - self.row_s)

    def take_one(self) -> bool:
        """Whether one more row should be decoded here; counts it against this step's slack."""
        if self.row_s is None or self.wait_s - self._taken < 2 * self.row_s:
            return False
        self._taken += 2 * self.row_s
        return True



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
