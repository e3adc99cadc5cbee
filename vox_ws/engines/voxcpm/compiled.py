"""The compiled step: the step's hottest pure tensor work through `torch.compile`, per batch bucket.

An eager step at small batch is bound by per-operator overhead (kernel launches on a GPU,
dispatch on a CPU), and most of a step's operators are the CFM's: nine LocDiT calls with CFG per
patch. Compiled here, each with `fullgraph=True` (no graph break, no host sync inside) and
shapes fixed per bucket (1, 2, 4, 8, ... up to the slots; a batch is padded up to its bucket by
repeating its last row, whose outputs are dropped):

- the CFM velocity: one LocDiT call on the conditioned and unconditioned halves, CFG-zero* and
  the guidance (`velocity`); the Euler loop around it stays in Python, so one graph per bucket
  serves every `inference_timesteps`;
- the LocEnc and its projection into the LM (`encode`).

Rows with different LoRA adapters go through the same graph: the runner gives every row a
mask inside these calls (zeros for no adapter), so the graph does not depend on the mix.

Not compiled (yet): the LMs' decode step (its attention length grows with each row's
position) and the streaming VAE (its carried state is per row, in the decoder process on a CPU).

Compiled code is cached on disk (`TORCHINDUCTOR_CACHE_DIR`, set from `--compile-cache`): a
second start with the same model, buckets and PyTorch only loads it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .lora import NO_ADAPTER

log = logging.getLogger("vox_ws.engines.voxcpm")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# One velocity call: what a solve of two timesteps makes (the first is CFG-zero*'s zero step).
WARM_UP_TIMESTEPS = 2


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
    return negative * st_star + cfg.view(b, 1, 1) * (positive - negative * st_star)


def encode(model: nn.Module, pred_feat: torch.Tensor) -> torch.Tensor:
    """The new patch into the LM: LocEnc and its projection. pred_feat [b, P, D] -> [b, H]."""
    return model.enc_to_lm_proj(model.feat_encoder(pred_feat.unsqueeze(1)))[:, 0, :]


def padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with its last row repeated up to `rows` rows."""
    extra = rows - tensor.shape[0]
    if extra <= 0:
        return tensor
    return torch.cat([tensor, tensor[-1:].expand(extra, *tensor.shape[1:])])


class CompiledStep:
    """The compiled pieces of one model's step, and the buckets they were compiled for."""

    def __init__(self, model: nn.Module, buckets: tuple[int, ...], cache_dir: str | os.PathLike | None = None) -> None:
        self.model = model
        self.buckets = tuple(sorted(buckets))
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # Read by inductor when it first compiles; a process compiles for one cache.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)
        dynamo = torch._dynamo.config
        limit = max(64, 4 * len(self.buckets))
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo, name) and getattr(dynamo, name) < limit:
                setattr(dynamo, name, limit)
        self.velocity = torch.compile(velocity, fullgraph=True, dynamic=False)
        self._encode = torch.compile(encode, fullgraph=True, dynamic=False)
        self.compile_s: dict[int, float] = {}

    def bucket(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"{rows} rows: over the largest compiled bucket ({self.buckets[-1]})")

    def encode(self, pred_feat: torch.Tensor) -> torch.Tensor:
        rows = pred_feat.shape[0]
        return self._encode(self.model, padded(pred_feat, self.bucket(rows)))[:rows]

    @torch.inference_mode()
    def warm_up(self, solve: Callable[..., torch.Tensor]) -> None:
        """Compile every bucket now (or load it from the cache): a CFM solve (`solve`, the
        runner's) and an encode of that many rows each, the log counting the buckets."""
        m = self.model
        dtype = next(m.parameters()).dtype
        device = next(m.parameters()).device
        hidden = m.lm_to_dit_proj.out_features + m.res_to_dit_proj.out_features
        for i, rows in enumerate(self.buckets):
            log.info("compiling the step for %d rows (%d/%d)", rows, i + 1, len(self.buckets))
            started = time.perf_counter()
            mu = torch.zeros(rows, hidden, device=device, dtype=dtype)
            cond = torch.zeros(rows, m.feat_dim, m.patch_size, device=device, dtype=dtype)
            noise = torch.randn(rows, m.feat_dim, m.patch_size, device=device, dtype=dtype)
            cfg = torch.full((rows,), 2.0, device=device, dtype=dtype)
            solved = solve(mu, cond, noise, WARM_UP_TIMESTEPS, cfg, [NO_ADAPTER] * rows)
            self.encode(solved.transpose(1, 2).contiguous())
            self.compile_s[rows] = round(time.perf_counter() - started, 1)
            log.info("compiled the step for %d rows in %.1f s", rows, self.compile_s[rows])
