"""The compiled step: the step's hottest pure tensor work through `torch.compile`, per batch bucket.

An eager step at small batch is bound by per-operator overhead (kernel launches on a GPU,
dispatch on a CPU), and most of a step's operators are the CFM's: nine LocDiT calls with CFG per
patch. Compiled here, each with `fullgraph=True` (no graph break, no host sync inside) and
shapes fixed per bucket (1, 2, 4, 8, ... up to the slots; a batch is padded up to its bucket by
repeating its last row, whose outputs are dropped):

- the CFM velocity: one LocDiT call on the conditioned and unconditioned halves, CFG-zero* and
  the guidance (`velocity`); the Euler loop around it stays in Python, so one graph per bucket
  serves every `inference_timesteps`;
- the rest of the generation (`advance`): the LocEnc and its projection, the stop head, and one
  decode step of both LMs over the KV slots, each row's new K and V written into its slot in
  place and attended up to its own position: in place (FlexAttention over the cache, no copy of
  the rows' prefixes; `kv.lm_step`), where this device's compiler has FlexAttention's kernel
  (`attention_choice.choose_attention`), else through the gather. The attention length is the one symbolic size
  (`kv.key_positions`): one graph per bucket serves every length. Nothing in it reads a value
  back to the host; the runner reads the stop flags once, after the whole step is queued;
- the streaming VAE decode (`vae.BatchedStreamingVAE.compile`), each row's carried convolution
  state an input and an output of the graph; in the decoder process too, on a CPU.

Rows with different LoRA adapters go through the same graphs: the runner gives every row's
adapter slot as an input of these calls (the zero slot for none), so a graph does not depend on
the mix.

Compiled graphs are kept on disk (`--compile-cache`; `graphs.GraphStore`): a second start with
the same model, buckets and PyTorch loads them without tracing or compiling. Loading them runs
their code, so a cache is read only when no other user can have written it (`cache_trust`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .attention_choice import choose_attention
from .cache_trust import KERNEL_CACHE_ENV, trusted_cache_dir
from .graph_check import Serving, check_step, decode_mismatch, verdict
from .graphs import GraphsBySize, GraphStore, bucket_of, padded
from .kv import RowPlaces, SlotKV, attention_name, key_positions, lm_step
from .lora import NO_ADAPTER, RowAdapters

log = logging.getLogger("vox_ws.engines.voxcpm")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# One velocity call: what a solve of two timesteps makes (the first is CFG-zero*'s zero step).
WARM_UP_TIMESTEPS = 2
# The package's sway sampling of the CFM's timesteps.
SWAY_SAMPLING_COEF = 1.0


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vox-ws" / "compile"


def buckets_for(rows: int, buckets: tuple[int, ...] = BUCKETS) -> tuple[int, ...]:
    """The buckets a step of up to `rows` rows needs: every one below, and the first at or above."""
    chosen = [b for b in sorted(buckets) if b < rows]
    above = [b for b in sorted(buckets) if b >= rows]
    return tuple(chosen + above[:1]) if above else tuple(chosen + [rows])


def velocity(cfm: nn.Module, x: torch.Tensor, mu_in: torch.Tensor, t_in: torch.Tensor, cond_in: torch.Tensor,
              dt_in: torch.Tensor, cfg: torch.Tensor) -> torch.Tensor:
    """One Euler step's velocity: the LocDiT on both halves, CFG-zero* and the guidance
    (UnifiedCFM's solve_euler). x [b, D, P]; the `_in` tensors carry 2b rows."""
    b = x.shape[0]
    out = cfm.estimator(torch.cat([x, x]), mu_in, t_in, cond_in, dt_in)
    positive, negative = out[:b], out[b:]
    st_star = cfm.optimized_scale(positive.reshape(b, -1), negative.reshape(b, -1)).view(b, 1, 1)
    # `cfg` is float32 whatever the model's dtype, as the package's Python float is (2.2 in
    # bfloat16 would be 2.203125): the product is taken in float32 and rounded once, as there.
    guided = (cfg.view(b, 1, 1) * (positive - negative * st_star)).to(positive.dtype)
    return negative * st_star + guided


def cfm_solve(cfm: nn.Module, mu: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor, n_timesteps: int,
               cfg_value: torch.Tensor, velocity_of: Any = velocity) -> torch.Tensor:
    """UnifiedCFM.forward + solve_euler with a per-row cfg_value and caller-drawn noise; each
    step's velocity from `velocity_of` (`velocity`, eager, or compiled through a graph).

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
    for step in range(1, len(t_span)):
        if step <= zero_init_steps:
            dphi_dt = torch.zeros_like(x)
        else:
            t_in = t.expand(2 * b)
            dt_in = dt.expand(2 * b) if cfm.mean_mode else torch.zeros(2 * b, device=x.device, dtype=x.dtype)
            dphi_dt = velocity_of(cfm, x, mu_in, t_in, cond_in, dt_in, cfg_value)
        x = x - dt * dphi_dt
        t = t - dt
        if step < len(t_span) - 1:
            dt = t - t_span[step + 1]
    return x


def encode(model: nn.Module, pred_feat: torch.Tensor) -> torch.Tensor:
    """The new patch into the LM: LocEnc and its projection. pred_feat [b, P, D] -> [b, H]."""
    return model.enc_to_lm_proj(model.feat_encoder(pred_feat.unsqueeze(1)))[:, 0, :]


def advance(model: nn.Module, base_k: list[torch.Tensor], base_v: list[torch.Tensor], residual_k: list[torch.Tensor],
            residual_v: list[torch.Tensor], pred_feat: torch.Tensor, lm_hidden: torch.Tensor, slots: torch.Tensor,
            positions: torch.Tensor, keys_at: torch.Tensor, places: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The generation after the CFM, for every row (`VoxCPM2Model._inference`'s loop body): the
    stop head on the LM state the patch was made from, the patch through the LocEnc into both
    LMs' next decode step (K and V written at `positions` of the caches, `SlotKV.k` / `.v`;
    attended in place where `places` is given, the graph's input table of the same slots and
    positions, else through the gather: `kv.lm_step`).
    pred_feat [b, P, D], lm_hidden [b, H] -> (stop flags [b] (1: stop), the LM's next hidden
    [b, H], the residual LM's [b, H])."""
    stop = model.stop_head(model.stop_actn(model.stop_proj(lm_hidden))).argmax(dim=-1)
    curr_embed = encode(model, pred_feat)
    at = RowPlaces(slots, positions, keys_at)
    hidden = model.fsq_layer(lm_step(model.base_lm, base_k, base_v, curr_embed, at, places))
    residual_in = model.fusion_concat_proj(torch.cat((hidden, curr_embed), dim=-1))
    return stop, hidden, lm_step(model.residual_lm, residual_k, residual_v, residual_in, at, places)


def _use_row_slots(adapters: RowAdapters | None, row_slots: torch.Tensor | None) -> None:
    """Hand the rows' LoRA slots to the adapted layers from inside the graph, where they are an
    input: read from the adapters outside it, they would be a constant of a saved graph."""
    if adapters is not None:
        adapters.row_slots = row_slots


def adapted_velocity(adapters: RowAdapters | None, row_slots: torch.Tensor | None, cfm: nn.Module, x: torch.Tensor,
                     mu_in: torch.Tensor, t_in: torch.Tensor, cond_in: torch.Tensor, dt_in: torch.Tensor,
                     cfg: torch.Tensor) -> torch.Tensor:
    _use_row_slots(adapters, row_slots)
    return velocity(cfm, x, mu_in, t_in, cond_in, dt_in, cfg)


def adapted_advance(adapters: RowAdapters | None, row_slots: torch.Tensor | None, model: nn.Module,
                    base_k: list[torch.Tensor], base_v: list[torch.Tensor], residual_k: list[torch.Tensor],
                    residual_v: list[torch.Tensor], pred_feat: torch.Tensor, lm_hidden: torch.Tensor,
                    slots: torch.Tensor, positions: torch.Tensor, keys_at: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _use_row_slots(adapters, row_slots)
    return advance(model, base_k, base_v, residual_k, residual_v, pred_feat, lm_hidden, slots, positions, keys_at)


def adapted_advance_in_place(adapters: RowAdapters | None, row_slots: torch.Tensor | None, model: nn.Module,
                             base_k: list[torch.Tensor], base_v: list[torch.Tensor], residual_k: list[torch.Tensor],
                             residual_v: list[torch.Tensor], pred_feat: torch.Tensor, lm_hidden: torch.Tensor,
                             places: torch.Tensor, keys_at: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`adapted_advance` attending in place, its rows' slots and positions given as one table
    (`places`, int64 [b, 2]: what the in-place attention's mask reads must be an input of the
    graph as it is, `kv.in_place_mask`)."""
    _use_row_slots(adapters, row_slots)
    return advance(model, base_k, base_v, residual_k, residual_v, pred_feat, lm_hidden, places[:, 0], places[:, 1],
                   keys_at, places)


# This package's modules that compiled graphs trace through.
TRACED_MODULES = ("compiled", "kv", "lora", "noise", "vae", "whole_step")


def traced_sources() -> str:
    """The source of this package's modules that compiled graphs trace through: part of every
    graph's key (`GraphStore(sources=...)`), in this process and the decoder process alike."""
    # Read from their files, not imported: `whole_step` imports this module.
    here = Path(__file__).parent
    return "".join((here / f"{name}.py").read_text() for name in TRACED_MODULES)


def adapted(adapters: RowAdapters | None, slots: list[int], gathered: bool = False) -> Any:
    """Row i of the calls inside speaks with adapter slot `slots[i]` (`gathered`: through the
    per-row gather whatever the mix, as a compiled graph takes it)."""
    return adapters.rows(slots, gathered) if adapters is not None else contextlib.nullcontext()


class EagerStep:
    """The step's two pieces as they are, for any number of rows (`CompiledStep` is the other
    way to run them; the runner takes whichever serves a call's rows)."""

    def __init__(self, model: nn.Module, adapters: RowAdapters | None = None) -> None:
        self.model = model
        self.adapters = adapters

    def solve(self, mu: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor, timesteps: int, cfg: torch.Tensor,
              adapter_slots: list[int]) -> torch.Tensor:
        """The CFM solve of these rows (row i with LoRA adapter slot `adapter_slots[i]`)."""
        with adapted(self.adapters, adapter_slots + adapter_slots, gathered=False):     # the CFG's two halves
            return cfm_solve(self.model.feat_decoder, mu, cond, noise, timesteps, cfg)

    def advance(self, base_kv: SlotKV, residual_kv: SlotKV, pred_feat: torch.Tensor, lm_hidden: torch.Tensor,
                at: RowPlaces, adapter_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`advance` of these rows: stop flags, and both LMs' next hidden states."""
        with adapted(self.adapters, adapter_slots, gathered=False):
            return advance(self.model, base_kv.k, base_kv.v, residual_kv.k, residual_kv.v, pred_feat, lm_hidden,
                           *at)


class CompiledStep:
    """The compiled pieces of one model's step, and the buckets they were compiled for."""

    def __init__(self, model: nn.Module, buckets: tuple[int, ...], cache_dir: str | os.PathLike | None = None,
                 adapters: RowAdapters | None = None, load_only: bool = False, cuda_graphs: bool = False) -> None:
        """`adapters`: the model's LoRA slots, where it has them (the runner gives every row's);
        `load_only`: graphs are only loaded from the cache, never compiled here (`GraphMissing`:
        what a background compile made is adopted); `cuda_graphs`: the whole step compiled as one
        graph per bucket too and replayed from CUDA graphs (`cuda_graphs.py`; a CUDA device, no
        LoRA slots). It attends as `attention_choice.choose_attention` says for the model's
        device (a process compiling for a server takes the server's choice: `take_choice`)."""
        if cuda_graphs and adapters is not None:
            raise ValueError("--cuda-graphs does not take LoRA slots (--lora-rank): their row map is chosen per step")
        self.model = model
        self.adapters = adapters
        self.buckets = tuple(sorted(buckets))
        # Its files are code the server runs: only a cache no one else can have written is read.
        self.cache_dir = trusted_cache_dir(Path(cache_dir) if cache_dir else default_cache_dir())
        use_cache_dir(self.cache_dir)
        self.store = GraphStore(self.cache_dir, sources=traced_sources(), load_only=load_only)
        context = model.config.model_dump_json()
        self._velocity = GraphsBySize(self.store, "velocity", adapted_velocity, context=context, rows_of="x")
        # How the advance attends (`choose_attention`): the server's answer, given to the process
        # that compiles for it; part of the graph's key, so a graph of the other kind is never adopted.
        self.attention = choose_attention(next(model.parameters()).device, (model.base_lm, model.residual_lm))
        self.in_place = self.attention.in_place
        # One graph for every attention length (the key positions' length is symbolic) and every
        # number of KV slots (the caches' first size is symbolic too): a background compile builds
        # the graphs with a cache of two slots beside a server holding many.
        self._advance = GraphsBySize(self.store, "advance",
                                     adapted_advance_in_place if self.in_place else adapted_advance,
                                     context=f"{context}\nattention {attention_name(self.in_place)}",
                                     rows_of="pred_feat", dynamic={"base_k": 0, "base_v": 0, "residual_k": 0,
                                                                   "residual_v": 0, "keys_at": 0})
        self.compile_s: dict[int, float] = {}
        self.ready: set[int] = set()     # the buckets whose graphs are loaded: steps of their rows use them
        # The decode's graphs loaded off the thread that steps, to be switched in there
        # (`BatchedStreamingVAE.prepare`, `runner.adopt`).
        self.prepared_decode: Any = None
        # Each bucket (or "decode") compared with eager off the thread that steps (`prepare`,
        # `prepare_decode`): None where it agreed, else why not. The thread that steps records
        # them (`mismatched`) and switches in what agreed (`runner.adopt`).
        self.verdicts: dict[int | str, str | None] = {}
        # What differed from the eager step (`graph_check`), by bucket (or "decode"): left eager.
        self.mismatched: dict[int | str, str] = {}
        # The whole step as one graph per bucket (`whole_step.py`; `BatchedVoxCPM2.compile_whole`):
        # what a CUDA device captures. Off until the device check has measured it.
        self.whole_step = cuda_graphs

    def serves(self, rows: int) -> bool:
        """Whether a call of `rows` rows goes through graphs loaded already (else it runs eager)."""
        return bucket_of(rows, self.buckets) in self.ready

    def solve(self, mu: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor, timesteps: int, cfg: torch.Tensor,
              adapter_slots: list[int]) -> torch.Tensor:
        """The CFM solve of these rows through the velocity's graph for their bucket, padded up
        to it (`EagerStep.solve`)."""
        count = mu.shape[0]
        rows = self._bucket(count)
        slots = adapter_slots + [NO_ADAPTER] * (rows - count)
        with adapted(self.adapters, slots + slots, gathered=True):           # the CFG's two halves
            solved = self._solve_padded(padded(mu, rows), padded(cond, rows), padded(noise, rows), timesteps,
                                        padded(cfg, rows))
        return solved[:count]

    def _solve_padded(self, mu: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor, timesteps: int,
                      cfg: torch.Tensor) -> torch.Tensor:
        """The CFM solve of a bucket's rows through the velocity's graph."""
        return cfm_solve(self.model.feat_decoder, mu, cond, noise, timesteps, cfg, self._velocity_graph)

    def advance(self, base_kv: SlotKV, residual_kv: SlotKV, pred_feat: torch.Tensor, lm_hidden: torch.Tensor,
                at: RowPlaces, adapter_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`advance` through its graph for the rows' bucket (`EagerStep.advance`); a padding row
        repeats the last row's inputs but writes into the KV's padding slot."""
        slots, positions, keys_at = at
        rows = pred_feat.shape[0]
        size = self._bucket(rows)
        padding_slots = slots.new_full((size - rows,), base_kv.padding_slot)
        with adapted(self.adapters, adapter_slots + [NO_ADAPTER] * (size - rows), gathered=True):
            places = (torch.cat([slots, padding_slots]), padded(positions, size))
            if self.in_place:       # one table (`adapted_advance_in_place`)
                places = (torch.stack(places, dim=1),)
            out = self._advance(self.adapters, self._row_slots(), self.model, base_kv.k, base_kv.v, residual_kv.k,
                                residual_kv.v, padded(pred_feat, size), padded(lm_hidden, size), *places, keys_at)
        return tuple(t[:rows] for t in out)

    def attention_kernels(self, base_kv: SlotKV, residual_kv: SlotKV, rows: int) -> list[str]:
        """The FlexAttention kernel each attention of the advance's graph for `rows` rows takes on
        a CUDA device (`flex_kernels.kernels_of`, asked of its shapes: traced, not compiled, not
        run), over these caches; [] where it attends through the gather."""
        from .flex_kernels import kernels_of

        m = self.model
        params = next(m.parameters())
        device, dtype = params.device, params.dtype
        slots = torch.full((rows,), base_kv.padding_slot, dtype=torch.long, device=device)
        positions = torch.ones(rows, dtype=torch.long, device=device)
        places = (torch.stack((slots, positions), dim=1),) if self.in_place else (slots, positions)
        args = (self.adapters, None, m, base_kv.k, base_kv.v, residual_kv.k, residual_kv.v,
                torch.zeros(rows, m.patch_size, m.feat_dim, device=device, dtype=dtype),
                torch.zeros(rows, m.base_lm.config.hidden_size, device=device, dtype=dtype), *places,
                key_positions([1], device))
        return kernels_of(self._advance.fn, args, self._advance.dynamic_for(rows))

    def _bucket(self, rows: int) -> int:
        size = bucket_of(rows, self.buckets)
        if size is None:
            raise ValueError(f"{rows} rows: over the largest compiled bucket ({self.buckets[-1]})")
        return size

    def _velocity_graph(self, cfm: nn.Module, x: torch.Tensor, mu_in: torch.Tensor, t_in: torch.Tensor,
                        cond_in: torch.Tensor, dt_in: torch.Tensor, cfg: torch.Tensor) -> torch.Tensor:
        """`velocity` through its graph for x's rows (a bucket: `solve` pads)."""
        return self._velocity(self.adapters, self._row_slots(), cfm, x, mu_in, t_in, cond_in, dt_in, cfg)

    def _row_slots(self) -> torch.Tensor | None:
        """The rows' LoRA slots the runner set for this call (`RowAdapters.rows(..., gathered=True)`)."""
        if self.adapters is None:
            return None
        if self.adapters.row_slots is None:
            raise RuntimeError("a compiled call with LoRA slots needs every row's slot")
        return self.adapters.row_slots

    def prepare(self, buckets: tuple[int, ...], eager: EagerStep, serving: Serving) -> None:
        """Load `buckets`' graphs, run each once and compare it with `eager` (`graph_check`), off
        the thread that steps (a background compile's reader): on the serving's KV caches in
        the slot kept for comparisons (`serving.slots[0]`: the key length a step attends over,
        and no request's memory), with eager on state of its own of the checked length; with
        LoRA slots each call holds the rows' adapter selection, as a step's call does
        (`RowAdapters.rows`). The buckets are not `ready` after: whoever steps records each
        one's `verdicts` and adopts those that agreed, between two steps (`runner.adopt`)."""
        self.warm_up(serving.base_kv, serving.residual_kv, buckets, mark_ready=False, slot=serving.slots[0])
        for rows in buckets:
            self.verdicts[rows] = verdict(check_step, self, eager, self.model, rows, serving)

    def prepare_decode(self, decoder: Any) -> None:
        """The decode's graphs loaded and run once (`BatchedStreamingVAE.prepare`) and compared
        with `decoder`'s eager decode, off the thread that decodes; `runner.adopt` switches to
        them where they agreed (`verdicts["decode"]`)."""
        prepared = decoder.prepare(self.buckets, self.model.patch_size, self.store)
        self.verdicts["decode"] = decode_mismatch(decoder, self.model.patch_size, prepared)
        self.prepared_decode = prepared

    @torch.inference_mode()
    def warm_up(self, base_kv: SlotKV, residual_kv: SlotKV, buckets: tuple[int, ...] | None = None,
                mark_ready: bool = True, slot: int | None = None) -> None:
        """Compile `buckets` (default: every one) now, or load them from the disk: a CFM solve
        and an advance of that many rows each, the log counting the buckets; each is `ready`
        after (unless not `mark_ready`). The advance writes K and V into `slot` alone (default:
        the padding slot)."""
        m = self.model
        dtype = next(m.parameters()).dtype
        device = next(m.parameters()).device
        hidden = m.lm_to_dit_proj.out_features + m.res_to_dit_proj.out_features
        for i, rows in enumerate(buckets or self.buckets):
            log.info("%s the step for %d rows (%d/%d)", "loading" if self.store.load_only else "compiling", rows,
                     i + 1, len(buckets or self.buckets))
            started = time.perf_counter()
            mu = torch.zeros(rows, hidden, device=device, dtype=dtype)
            cond = torch.zeros(rows, m.feat_dim, m.patch_size, device=device, dtype=dtype)
            noise = torch.randn(rows, m.feat_dim, m.patch_size, device=device, dtype=dtype)
            cfg = torch.full((rows,), 2.0, device=device, dtype=torch.float32)
            solved = self.solve(mu, cond, noise, WARM_UP_TIMESTEPS, cfg, [NO_ADAPTER] * rows)
            # Position 1 of 0..1: a length of 2, as no real step has less (a symbolic size is
            # specialised for 0 and 1).
            slots = torch.full((rows,), base_kv.padding_slot if slot is None else slot, dtype=torch.long,
                               device=device)
            positions = torch.ones(rows, dtype=torch.long, device=device)
            self.advance(base_kv, residual_kv, solved.transpose(1, 2).contiguous(),
                         torch.zeros(rows, m.base_lm.config.hidden_size, device=device, dtype=dtype),
                         RowPlaces(slots, positions, key_positions([1], device)), [NO_ADAPTER] * rows)
            self.compile_s[rows] = round(time.perf_counter() - started, 1)
            if mark_ready:
                self.ready.add(rows)
            log.info("%s the step for %d rows in %.1f s", "loaded" if self.store.load_only else "compiled", rows,
                     self.compile_s[rows])


def warm_compiler(device_type: str) -> None:
    """What a process pays once before its first compiled graph, done ahead (in a thread while
    the weights load: it mostly waits on subprocesses): importing inductor and, on a CPU,
    probing which vector instructions its C++ may use (a build and a load in a child process
    per instruction set, some 4 s on a small CPU)."""
    import torch._inductor.codecache  # noqa: F401
    from torch._inductor import cpu_vec_isa

    if device_type == "cpu":
        cpu_vec_isa.pick_vec_isa()


def untimed_kernels() -> None:
    """Make inductor generate GPU kernels that need no timing at their first call: one launch
    configuration each (pointwise autotuning off; its deterministic mode, which picks a
    reduction's and a template's configuration by rule instead of by benchmark). For the
    background compile: the graphs it makes are loaded and first run beside a serving process,
    where a benchmark of candidate configurations would be timed against the serving's kernels
    (and slow its steps), and would pick by that skewed timing. A graph compiled at start
    (`--compile-wait`, `--cuda-graphs`) is tuned as usual: nothing serves yet."""
    from torch._inductor import config

    config.deterministic = True
    config.triton.autotune_pointwise = False


def use_cache_dir(cache_dir: Path) -> Path:
    """Keep compiled code in `cache_dir` (one `trusted_cache_dir` gave: this process compiles for
    one cache), and allow a recompile per bucket for every compiled function; gives `cache_dir`.

    Inductor keeps its precompiled C++ headers in `$TMPDIR/torchinductor_<user>` whatever its
    cache directory is (`codecache._HEADER_DIR`, fixed at import), and builds kernels against a
    header found there: another local user who makes that directory first puts code into every
    kernel. They go into `cache_dir` too.

    `VOX_WS_KERNEL_CACHE` names another directory for inductor's kernels and headers (checked as
    `cache_dir` is): several compile caches then share the kernels they have in common, as the
    test suite's runs do (one per run, for every test that compiles into a cache of its own)."""
    shared = os.environ.get(KERNEL_CACHE_ENV)
    kernels = trusted_cache_dir(Path(shared)) if shared else cache_dir
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(kernels)
    from torch._inductor import codecache

    if hasattr(codecache, "_HEADER_DIR"):
        codecache._HEADER_DIR = str(kernels / "precompiled_headers")
        codecache._HEADER_LOCK_DIR = str(kernels / "precompiled_headers" / "locks")
    dynamo = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, name) and getattr(dynamo, name) < 64:
            setattr(dynamo, name, 64)
    return cache_dir
