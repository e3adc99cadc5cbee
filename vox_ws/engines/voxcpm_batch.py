"""A batched VoxCPM2 generation loop written over the model's own modules.

The voxcpm package generates one request at a time: its KV caches live on the modules with
batch 1, its stop test reads row 0, and its streaming VAE decoder keeps state in patched module
forwards. This runner keeps every piece of per-request state apart so that any set of requests,
admitted at different times, advances together:

- KV caches: one slot per request in per-layer tensors; each row has its own position and
  attends to its own prefix through a mask (`_lm_step`).
- CFM: one Euler solve per group of requests sharing `inference_timesteps`, each row with its
  own `cfg_value` and its own noise drawn from the request's generator (`_cfm_solve`).
- Stop head, LocEnc, projections: plain batched calls.
- VAE: the package's causal streaming decode, with each request's carried convolution state
  stacked into the batch for one call and split back after (`BatchedStreamingVAE`); on a CPU
  it runs in the decoder process (`vae_process.py`), overlapped with the next step.

Every formula mirrors `VoxCPM2Model._inference` and `UnifiedCFM`, so one request's audio equals
what the package produces alone for it (same weights, same noise); tests/test_voxcpm_equivalence.py
checks it.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .vae_process import DecoderProcess

# Warming the VAE up for more rows stops once one decode takes this long.
WARM_UP_ENOUGH_S = 0.5
# Same sway-sampling and CFG-zero* settings as UnifiedCFM.forward's defaults.
SWAY_SAMPLING_COEF = 1.0
# The package caps generation at this many steps per target-text token (+10).
STEPS_PER_TOKEN = 6.0


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
    end_reason: str | None = None    # generation has ended; the last audio may still be decoding
    patches: list[torch.Tensor] | None = None   # generated latents, kept to continue from
    text: str = ""                              # the text these latents say
    pending: tuple[Future, int] | None = None   # (decode job, row in it) still in flight


@dataclass
class Prompt:
    """Model inputs for one request, as `_generate_with_prompt_cache` builds them."""

    text_tokens: torch.Tensor   # [T] int
    text_mask: torch.Tensor     # [T] int
    audio_feat: torch.Tensor    # [T, P, D]
    audio_mask: torch.Tensor    # [T] int
    target_tokens: int          # tokens of the target text alone (the length cap counts these)


def prompt_positions(model: Any, target_text: str, cache: dict | None) -> tuple[int, int]:
    """(positions the prompt of `build_prompt` takes, tokens of the target text), counted
    without building it: cheap enough for the event loop, and no torch."""
    tokenize = model.text_tokenizer
    mode = "zero_shot" if cache is None else cache.get("mode", "continuation")
    text = target_text
    if mode in ("continuation", "ref_continuation"):
        text = cache.get("prompt_text", "") + target_text
    positions = len(tokenize(text)) + 1                      # + audio_start
    if mode in ("reference", "ref_continuation"):
        positions += cache["ref_audio_feat"].shape[0] + 2    # ref_start ... ref_end
    if mode in ("continuation", "ref_continuation"):
        positions += cache["audio_feat"].shape[0]
    return positions, len(tokenize(target_text))


class SlotKV:
    """Per-layer K and V for `slots` requests of up to `max_len` positions each."""

    def __init__(self, lm: nn.Module, slots: int, max_len: int, device: Any, dtype: torch.dtype) -> None:
        cfg = lm.config
        head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len

    def fill(self, slot: int, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # Zero the whole slot first: masked-out positions must hold finite values.
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()
        length = caches[0][0].size(2)
        for layer, (k, v) in enumerate(caches):
            self.k[layer, slot, :, :length] = k[0]
            self.v[layer, slot, :, :length] = v[0]


def build_prompt(model: Any, target_text: str, cache: dict | None) -> Prompt:
    """The token/feature sequence for one request (mirrors `_generate_with_prompt_cache`)."""
    tokenize = model.text_tokenizer
    mode = "zero_shot" if cache is None else cache.get("mode", "continuation")
    text = target_text
    if mode in ("continuation", "ref_continuation"):
        text = cache.get("prompt_text", "") + target_text
    tokens = torch.cat([torch.LongTensor(tokenize(text)), torch.tensor([model.audio_start_token], dtype=torch.int32)])
    n_text = tokens.shape[0]
    zeros_feat = torch.zeros((n_text, model.patch_size, model.audio_vae.latent_dim), dtype=torch.float32)
    ones_text = torch.ones(n_text, dtype=torch.int32)
    zeros_text = torch.zeros(n_text, dtype=torch.int32)
    seq_tokens, seq_feat, seq_tmask, seq_amask = [], [], [], []
    if mode in ("reference", "ref_continuation"):
        ref_tokens, ref_feats, ref_t_mask, ref_a_mask = model._make_ref_prefix(cache["ref_audio_feat"], tokens.device)
        seq_tokens.append(ref_tokens)
        seq_feat.append(ref_feats)
        seq_tmask.append(ref_t_mask)
        seq_amask.append(ref_a_mask)
    seq_tokens.append(tokens)
    seq_feat.append(zeros_feat)
    seq_tmask.append(ones_text)
    seq_amask.append(zeros_text)
    if mode in ("continuation", "ref_continuation"):
        prompt_feat = cache["audio_feat"]
        n_audio = prompt_feat.size(0)
        seq_tokens.append(torch.zeros(n_audio, dtype=torch.int32))
        seq_feat.append(prompt_feat)
        seq_tmask.append(torch.zeros(n_audio, dtype=torch.int32))
        seq_amask.append(torch.ones(n_audio, dtype=torch.int32))
    return Prompt(
        text_tokens=torch.cat(seq_tokens),
        text_mask=torch.cat(seq_tmask),
        audio_feat=torch.cat(seq_feat, dim=0),
        audio_mask=torch.cat(seq_amask),
        target_tokens=len(tokenize(target_text)),
    )


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


class BatchedVoxCPM2:
    """Runs prefill per request and one batched generation step for any set of requests."""

    def __init__(self, model: Any, max_batch: int, decode_process: bool | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = model._dtype()
        self.max_batch = max_batch
        self.max_len = model.config.max_length
        self.base_kv = SlotKV(model.base_lm, max_batch, self.max_len, self.device, self.dtype)
        self.residual_kv = SlotKV(model.residual_lm, max_batch, self.max_len, self.device, self.dtype)
        fold_weight_norm(model.audio_vae)
        on_cpu = self.device.type == "cpu"
        # On a CPU, decoding more than ~8 rows in one call falls out of cache (B=16 took 54 ms
        # in one call, 32 ms in two); a GPU wants every row in one call.
        rows_per_call = 8 if on_cpu else None
        # On a CPU with a core to spare, the decode of step k runs in the decoder process while
        # this thread generates step k+1 (each row's audio comes one step later, except its first
        # patch, decoded here at once). On a GPU the kernels are asynchronous already. Started
        # first: it loads and warms up while this process does.
        if decode_process is None:
            decode_process = on_cpu and _usable_cpus() >= 2
        self._decoder: DecoderProcess | None = None
        self._balance = DecodeBalance()
        if decode_process:
            vae = model.audio_vae
            self._decoder = DecoderProcess(type(vae), getattr(model.config, "audio_vae_config", None),
                                           vae.state_dict(), threads=torch.get_num_threads(),
                                           rows_per_call=rows_per_call, warm_up=(model.patch_size, max_batch))
        self.vae = BatchedStreamingVAE(model.audio_vae, rows_per_call=rows_per_call, fold_depthwise=on_cpu)
        if on_cpu:
            self.vae.warm_up(model.patch_size, max_batch)
        self._free_slots = list(range(max_batch))
        self._row_keys = itertools.count(1)
        cfg = model.config.lm_config
        self.scale_emb = cfg.scale_emb if cfg.use_mup else 1.0
        self.samples_per_step = model.patch_size * model._decode_chunk_size

    def wait_ready(self) -> None:
        """Block until the decoder process, if there is one, can take work."""
        if self._decoder is not None:
            self._decoder.wait_ready()

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

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, *, seed: int, cfg_value: float, timesteps: int, min_len: int,
                max_len: int) -> RowState:
        if not self._free_slots:
            raise RuntimeError("no free KV slot")
        m = self.model
        slot = self._free_slots.pop(0)
        try:
            text = prompt.text_tokens.unsqueeze(0).to(self.device)
            text_mask = prompt.text_mask.unsqueeze(0).to(self.device)
            feat = prompt.audio_feat.unsqueeze(0).to(self.device).to(self.dtype)
            feat_mask = prompt.audio_mask.unsqueeze(0).to(self.device)

            encoder = getattr(m, "_feat_encoder_raw", m.feat_encoder)
            feat_embed = m.enc_to_lm_proj(encoder(feat))
            text_embed = m.base_lm.embed_tokens(text) * self.scale_emb
            combined = text_mask.unsqueeze(-1) * text_embed + feat_mask.unsqueeze(-1) * feat_embed

            enc_outputs, kv = m.base_lm(inputs_embeds=combined, is_causal=True)
            self.base_kv.fill(slot, kv)
            enc_outputs = m.fsq_layer(enc_outputs) * feat_mask.unsqueeze(-1) + enc_outputs * text_mask.unsqueeze(-1)
            residual_in = m.fusion_concat_proj(torch.cat((enc_outputs, feat_mask.unsqueeze(-1) * feat_embed), dim=-1))
            residual_out, residual_kv = m.residual_lm(inputs_embeds=residual_in, is_causal=True)
            self.residual_kv.fill(slot, residual_kv)
        except BaseException:
            self._free_slots.append(slot)
            raise
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return RowState(
            slot=slot,
            key=next(self._row_keys),
            position=text.shape[1],
            lm_hidden=enc_outputs[0, -1, :].clone(),
            residual_hidden=residual_out[0, -1, :].clone(),
            prefix_cond=feat[0, -1].clone(),
            generator=generator,
            cfg_value=cfg_value,
            timesteps=timesteps,
            min_len=min_len,
            max_steps=self.max_steps(prompt.target_tokens, max_len),
        )

    def release(self, row: RowState) -> None:
        if row.slot not in self._free_slots:
            self._free_slots.append(row.slot)
            self._free_slots.sort()
        if row.vae_state is None and self._decoder is not None:
            row.vae_state = {}
            self._decoder.forget([row.key])

    # ------------------------------------------------------------------ one step

    def step(self, rows: list[RowState]) -> list[tuple[torch.Tensor | None, str | None]]:
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
            audio = self._decode(latents[here], [rows[i].vae_state for i in here])
            for j, i in enumerate(here):
                now[id(rows[i])] = (audio, j)
        return now

    def _gather(self, rows: list[RowState], earlier: dict[int, tuple[Future, int]],
                now: dict[int, tuple[torch.Tensor, int]], stepped: bool) -> list[tuple[torch.Tensor | None, str | None]]:
        """Each row's audio: what the decoder process made of its previous patch, then what was
        decoded here in this step."""
        results: list[tuple[torch.Tensor | None, str | None]] = []
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
    def _decode(self, latents: torch.Tensor, states: list[dict[int, torch.Tensor]]) -> torch.Tensor:
        return self.vae.decode(latents, states).cpu()

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
            idx = torch.tensor(index, device=self.device)
            noise = torch.cat([
                torch.randn((1, m.feat_dim, m.patch_size), generator=rows[i].generator, device=self.device,
                            dtype=self.dtype) for i in index
            ])
            cfg = torch.tensor([rows[i].cfg_value for i in index], device=self.device, dtype=self.dtype)
            solved = _cfm_solve(m.feat_decoder, dit_hidden[idx], cond[idx].transpose(1, 2).contiguous(), noise,
                                timesteps, cfg)
            pred_feat[idx] = solved.transpose(1, 2)                            # [b, P, D]

        curr_embed = m.enc_to_lm_proj(m.feat_encoder(pred_feat.unsqueeze(1)))[:, 0, :]   # [B, H]
        latents = pred_feat.transpose(1, 2).to(torch.float32)                  # b d p  (t = 1)

        stop = m.stop_head(m.stop_actn(m.stop_proj(lm_hidden))).argmax(dim=-1).cpu().tolist()
        going: list[int] = []
        for i, row in enumerate(rows):
            if row.step > row.min_len and stop[i] == 1:
                row.end_reason = "done"
            elif row.step + 1 >= row.max_steps:
                row.end_reason = "max_len"
            row.step += 1
            row.prefix_cond = pred_feat[i]
            if row.patches is not None:
                row.patches.append(pred_feat[i].detach().to("cpu", torch.float32))
            if row.end_reason is None:
                going.append(i)
        if going:
            self._advance([rows[i] for i in going], curr_embed[going])
        return latents

    def _advance(self, rows: list[RowState], curr_embed: torch.Tensor) -> None:
        """Feed the new patch through the base and residual LMs (one decode step each)."""
        m = self.model
        slots = torch.tensor([r.slot for r in rows], device=self.device)
        positions = torch.tensor([r.position for r in rows], device=self.device)
        lm_hidden = _lm_step(m.base_lm, self.base_kv, curr_embed, slots, positions)
        lm_hidden = m.fsq_layer(lm_hidden)
        residual_in = m.fusion_concat_proj(torch.cat((lm_hidden, curr_embed), dim=-1))
        residual_hidden = _lm_step(m.residual_lm, self.residual_kv, residual_in, slots, positions)
        for i, row in enumerate(rows):
            row.lm_hidden = lm_hidden[i]
            row.residual_hidden = residual_hidden[i]
            row.position += 1


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


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):   # Linux: the CPUs this process may run on
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _groups(rows: list[RowState], key) -> list[tuple[Any, list[int]]]:
    groups: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(key(row), []).append(i)
    return list(groups.items())


def _lm_step(lm: nn.Module, kv: SlotKV, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """MiniCPMModel.forward_step for a batch whose rows sit at different positions in their own
    KV slots. x: [B, H] -> [B, H]."""
    from voxcpm.modules.minicpm4.model import apply_rotary_pos_emb

    batch = x.shape[0]
    length = int(positions.max().item()) + 1
    if lm.rope_emb is not None:
        cos = lm.rope_emb.cos_cached[positions].view(batch, 1, 1, -1)
        sin = lm.rope_emb.sin_cached[positions].view(batch, 1, 1, -1)
    mask = (torch.arange(length, device=x.device).view(1, -1) <= positions.view(-1, 1)).view(batch, 1, 1, length)
    contiguous = bool(torch.equal(slots, torch.arange(batch, device=slots.device)))
    hidden = x
    for index, layer in enumerate(lm.layers):
        attn = layer.self_attn
        residual = hidden
        h = layer.input_layernorm(hidden)
        q = attn.q_proj(h).view(batch, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(batch, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(batch, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
        if lm.rope_emb is not None:
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        layer_k, layer_v = kv.k[index], kv.v[index]
        layer_k[slots, :, positions] = k[:, :, 0]
        layer_v[slots, :, positions] = v[:, :, 0]
        if contiguous:
            keys, values = layer_k[:batch, :, :length], layer_v[:batch, :, :length]
        else:
            keys, values = layer_k[slots, :, :length], layer_v[slots, :, :length]
        out = F.scaled_dot_product_attention(q.contiguous(), keys.contiguous(), values.contiguous(), attn_mask=mask,
                                             enable_gqa=True)
        out = attn.o_proj(out.transpose(1, 2).reshape(batch, attn.num_heads * attn.head_dim))
        hidden = residual + _depth_scaled(layer, out)
        residual = hidden
        hidden = residual + _depth_scaled(layer, layer.mlp(layer.post_attention_layernorm(hidden)))
    return lm.norm(hidden)


def _depth_scaled(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    if layer.use_mup:
        return h * (layer.scale_depth / math.sqrt(layer.num_hidden_layers))
    return h


def _cfm_solve(cfm: nn.Module, mu: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor, n_timesteps: int,
               cfg_value: torch.Tensor) -> torch.Tensor:
    """UnifiedCFM.forward + solve_euler with a per-row cfg_value and caller-drawn noise.

    mu [b, H_dit*2], cond [b, D, P], noise [b, D, P], cfg_value [b] -> x [b, D, P].
    """
    b = mu.shape[0]
    t_span = torch.linspace(1, 0, n_timesteps + 1, device=mu.device, dtype=mu.dtype)
    t_span = t_span + SWAY_SAMPLING_COEF * (torch.cos(torch.pi / 2 * t_span) - 1 + t_span)
    x = noise
    t, dt = t_span[0], t_span[0] - t_span[1]
    zero_init_steps = max(1, int(len(t_span) * 0.04))
    mu_in = torch.cat([mu, torch.zeros_like(mu)])
    cond_in = torch.cat([cond, cond])
    cfg = cfg_value.view(b, 1, 1)
    for step in range(1, len(t_span)):
        if step <= zero_init_steps:
            dphi_dt = torch.zeros_like(x)
        else:
            t_in = t.expand(2 * b)
            dt_in = dt.expand(2 * b) if cfm.mean_mode else torch.zeros(2 * b, device=x.device, dtype=x.dtype)
            out = cfm.estimator(torch.cat([x, x]), mu_in, t_in, cond_in, dt_in)
            positive, negative = out[:b], out[b:]
            st_star = cfm.optimized_scale(positive.reshape(b, -1), negative.reshape(b, -1)).view(b, 1, 1)
            dphi_dt = negative * st_star + cfg * (positive - negative * st_star)
        x = x - dt * dphi_dt
        t = t - dt
        if step < len(t_span) - 1:
            dt = t - t_span[step + 1]
    return x
