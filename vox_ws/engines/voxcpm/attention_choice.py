"""How a compiled step attends on its device: in place (FlexAttention over the KV slots as they
are, `kv.attend_in_place`), or through the gather, where the in-place attention cannot be had.

Whether the device's compiler has FlexAttention's kernel at all is known without compiling
(`kv.in_place_attention`: Triton on a GPU, AVX2 on a CPU); whether it compiles and runs for this
model is not: a FlexAttention lowering or a Triton compile that fails would fail every compiled
step, and with it `--compile-wait` and `--cuda-graphs` would fail the engine's start. So on a GPU
the in-place attention is tried first, once per process and LM shape (`probe_in_place`: one small
compile of the in-place attention at the LMs' heads and dtype, run and compared with the gather);
where it fails, compiled steps attend through the gather, the log says why, and so does
`/v1/info` (`AttentionChoice`). A CPU's is not probed (its kernel's one requirement is checked,
and its compile would cost every start some 20 s here); `PROBES` is where a test puts one.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from .kv import KV_BLOCK, attend, attend_in_place, in_place_attention, in_place_mask, in_place_unavailable

log = logging.getLogger("vox_ws.engines.voxcpm")

# The largest difference of the probe's result from the gather's, relative to its largest value.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 4e-2, torch.float16: 1e-2}


class AttentionChoice(NamedTuple):
    """How compiled steps attend here: `in_place`, else why not (`why_not`); and the kernel
    the probe's compile lowered FlexAttention to, where one was lowered (`flex_kernels`)."""

    in_place: bool
    why_not: str | None = None
    kernel: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"in_place": self.in_place, "why_not": self.why_not, "kernel": self.kernel}


Probe = Callable[[torch.device, nn.Module, torch.dtype], "str | None"]


def probe_in_place(device: torch.device, lm: nn.Module, dtype: torch.dtype) -> str | None:
    """Compile and run the in-place attention once at `lm`'s heads on `device` in `dtype`, as a
    step's graph has it (`fullgraph`, a static batch, the slot count symbolic): two rows in two
    of three slots, one past the first block; raises where it fails or differs from the gather.
    The kernel the lowering chose (`flex_kernels.lowered`), or None where none was lowered."""
    from .flex_kernels import lowered, summary
    from .graph_check import difference

    cfg = lm.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.kv_channels or cfg.hidden_size // heads
    generator = torch.Generator(device="cpu").manual_seed(0)
    stored = (kv_heads, 3, 2 * KV_BLOCK, head_dim)
    cache_k, cache_v = (torch.randn(stored, generator=generator).to(device, dtype).transpose(0, 1) for _ in range(2))
    query = torch.randn(2, heads, 1, head_dim, generator=generator).to(device, dtype)
    places = torch.tensor([[0, KV_BLOCK + 5], [1, 3]], device=device)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return attend_in_place(q, k, v, in_place_mask(at, k.shape[0], k.shape[2]))

    for cache in (cache_k, cache_v):
        torch._dynamo.maybe_mark_dynamic(cache, 0)
    with torch.inference_mode(), lowered() as kernels:
        got = torch.compile(attention, fullgraph=True, dynamic=False)(query, cache_k, cache_v, places)
        length = KV_BLOCK + 6
        mask = (torch.arange(length, device=device).view(1, -1) <= places[:, 1].view(-1, 1)).view(2, 1, 1, length)
        want = attend(query, cache_k[places[:, 0], :, :length], cache_v[places[:, 0], :, :length], mask)
    off = difference(got, want)
    if not off <= PROBE_TOLERANCE.get(dtype, 4e-2):
        raise RuntimeError(f"the compiled in-place attention differs from the gather by {off:.2e}")
    return summary(kernels) if kernels else None


# Per device type, how the in-place attention is tried before compiled steps use it.
PROBES: dict[str, Probe] = {"cuda": probe_in_place}


def choose_attention(device: Any, lms: tuple[nn.Module, ...] = ()) -> AttentionChoice:
    """How compiled steps on `device` attend for the LMs `lms` (their heads and dtype): in place
    where this device's compiler has FlexAttention's kernel and, where the device is probed
    (`PROBES`), the probe passed at each LM's shape; else through the gather, said once in the
    log. Probed once per process, device and shape."""
    device = torch.device(device)
    if device.type in _TAKEN:
        return _TAKEN[device.type]
    if not in_place_attention(device):
        return AttentionChoice(False, in_place_unavailable(device.type))
    probe = PROBES.get(device.type)
    if probe is None:
        return AttentionChoice(True)
    by_shape = {_shape_of(lm): lm for lm in lms}
    key = (probe, str(device), tuple(sorted(by_shape)))
    if key not in _PROBED:
        _PROBED[key] = _probed(probe, device, by_shape)
    return _PROBED[key]


# What each probe found, by (probe, device, the LMs' shapes).
_PROBED: dict[tuple, AttentionChoice] = {}
# The choices taken from a server, by device type (`take_choice`).
_TAKEN: dict[str, AttentionChoice] = {}


def take_choice(device: Any, in_place: bool) -> None:
    """In a process that compiles for a server (the background compile), attend as the server
    chose (`in_place`), on every device of `device`'s type: its graphs must be the ones the server
    looks for, whatever a probe here would find."""
    _TAKEN[torch.device(device).type] = AttentionChoice(in_place, None if in_place else "as the server attends")


def _shape_of(lm: nn.Module) -> tuple[int, int, int, str]:
    cfg = lm.config
    return (cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads, str(next(lm.parameters()).dtype))


def _probed(probe: Probe, device: torch.device, by_shape: dict[tuple, nn.Module]) -> AttentionChoice:
    kernels = []
    for lm in by_shape.values():
        try:
            kernel = probe(device, lm, next(lm.parameters()).dtype)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the gather, which compiles everywhere
            why = f"the in-place attention failed its probe on {device} ({type(exc).__name__}: {exc})"[:500]
            log.warning("compiled steps on %s attend through the gather: %s", device, why)
            return AttentionChoice(False, why)
        if kernel:
            kernels.append(kernel)
    return AttentionChoice(True, None, ", ".join(dict.fromkeys(kernels)) or None)
