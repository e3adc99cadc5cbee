"""Benchmark: the decode step's attention, the call it replaced against `kv.attend`.

Before: `scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=True)`, which no fast
kernel takes (FlashAttention takes no mask, the memory-efficient kernel no unequal head counts),
so it runs on the math kernel with K and V repeated per query head. After: `kv.attend`, the
query heads of each KV head folded into the query length. Both at the released LM's heads (16
query heads over 2 KV heads of 128) for several batch sizes and attention lengths, each row at
its own length (the mask), with the kernel each runs on:

    python -m benchmarks.attention [--device cuda] [--dtype bfloat16] [--batches 1,8,32,64]
                                   [--lengths 100,1000]

`--gather` measures instead what the step pays before the attention: each row's keys and
values gathered out of its KV slot (`layer_k[slots, :, :length]`, as `kv.lm_step` does, from a
cache of one slot per row plus the padding slot, `--max-len` positions each), against the
attention over what was gathered; at 4,000 and 8,000 positions the gather is the copy of every
row's whole prefix, twice a layer:

    python -m benchmarks.attention --gather --lengths 4000,8000 [--device cuda --dtype bfloat16]

`--in-place` measures the two ways a compiled step attends (`kv.lm_step`), each compiled as the
step is (`fullgraph=True`; the cache's slot count symbolic, and for the gather the batch and the
attention length too; the in-place graph a static batch, as FlexAttention's decoding kernel
wants): the gather and `kv.attend` after it, against FlexAttention over the cache as it is
(`kv.attend_in_place`, its block mask made in the graph), on a `kv.SlotKV`-laid cache of one
slot per row plus the padding slot, `--max-len` positions each, each row at its own position,
with the kernel inductor's CUDA lowering takes for the in-place graph:

    python -m benchmarks.attention --in-place --lengths 100,1000,4000,8000 [--device cuda]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any, Callable

HEADS, KV_HEADS, HEAD_DIM = 16, 2, 128


def inputs(batch: int, length: int, device: Any, dtype: Any, seed: int = 0) -> tuple:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, generator=generator).to(device, dtype)
    k = torch.randn(batch, KV_HEADS, length, HEAD_DIM, generator=generator).to(device, dtype)
    v = torch.randn(batch, KV_HEADS, length, HEAD_DIM, generator=generator).to(device, dtype)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    lengths[0] = length
    mask = (torch.arange(length).view(1, -1) < lengths.view(-1, 1)).view(batch, 1, 1, length).to(device)
    return q, k, v, mask


def before(q, k, v, mask):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def time_ms(fn: Callable, args: tuple, device: Any, repeats: int) -> float:
    """The median of `repeats` calls, after three warm-up calls."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        fn(*args)
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(*args)
        sync()
        times.append((time.perf_counter() - started) * 1000)
    return sorted(times)[len(times) // 2]


def run(device: str, dtype: str, batches: list[int], lengths: list[int], repeats: int = 20) -> list[dict]:
    import torch

    from vox_ws.engines.voxcpm.kv import attend, sdpa_kernel_of

    device_ = torch.device(device)
    dtype_ = getattr(torch, dtype)
    rows = []
    with torch.inference_mode():
        for length in lengths:
            for batch in batches:
                args = inputs(batch, length, device_, dtype_)
                old = before(*args).reshape(batch, HEADS, HEAD_DIM).float()
                new = attend(*args).float()
                rows.append({
                    "batch": batch, "length": length,
                    "before_ms": round(time_ms(before, args, device_, repeats), 4),
                    "after_ms": round(time_ms(attend, args, device_, repeats), 4),
                    "before_kernel": sdpa_kernel_of(before, args), "after_kernel": sdpa_kernel_of(attend, args),
                    "max_abs_diff": float((old - new).abs().max()),
                })
                if device_.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def gather_rows(device: str, dtype: str, batches: list[int], lengths: list[int], max_len: int,
                repeats: int = 20) -> list[dict]:
    """Per batch and length: the gather of K and V out of the slots, and the attention after it."""
    import torch

    from vox_ws.engines.voxcpm.kv import attend

    device_, dtype_ = torch.device(device), getattr(torch, dtype)
    rows = []
    with torch.inference_mode():
        for length in lengths:
            for batch in batches:
                cache_k = torch.zeros(batch + 1, KV_HEADS, max(max_len, length), HEAD_DIM, device=device_, dtype=dtype_)
                cache_v = torch.zeros_like(cache_k)
                slots = torch.randperm(batch, device=device_)

                def gather(k=cache_k, v=cache_v, s=slots, n=length):
                    return k[s, :, :n], v[s, :, :n]

                q, _, _, mask = inputs(batch, length, device_, dtype_)
                keys, values = gather()
                rows.append({"batch": batch, "length": length,
                             "gather_ms": round(time_ms(gather, (), device_, repeats), 4),
                             "attend_ms": round(time_ms(attend, (q, keys, values, mask), device_, repeats), 4)})
                del cache_k, cache_v, keys, values
                if device_.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _gather_attention(q, cache_k, cache_v, slots, positions, keys_at):
    """What `kv.lm_step` does for one layer without `in_place`: gather, then `attend`."""
    from vox_ws.engines.voxcpm.kv import attend

    length = keys_at.shape[0]
    mask = (keys_at.view(1, -1) <= positions.view(-1, 1)).view(-1, 1, 1, length)
    return attend(q, cache_k[slots, :, :length], cache_v[slots, :, :length], mask)


def _in_place_attention(q, cache_k, cache_v, places):
    """What `kv.lm_step` does for one layer in place: the block mask, then FlexAttention."""
    from vox_ws.engines.voxcpm.kv import attend_in_place, in_place_mask

    mask = in_place_mask(places, cache_k.shape[0], cache_k.shape[2])
    return attend_in_place(q, cache_k, cache_v, mask)


# How each is compiled, as a step's graph is: the slot count symbolic in both; the batch (and
# the attention length) symbolic where it gathers, as the whole step's graph for buckets from 2
# has them (`whole_step.symbolic_sizes`), static where it attends in place: a graph per batch,
# as inductor lowers FlexAttention to its decoding kernel only with a static batch
# (`flex_kernels.py`).
GATHER_DYNAMIC = {"q": 0, "cache_k": 0, "cache_v": 0, "slots": 0, "positions": 0, "keys_at": 0}
IN_PLACE_DYNAMIC = {"cache_k": 0, "cache_v": 0}


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    """`fn` compiled as a step is, once per process: a caller timing one batch at a time (the
    device check, which keeps each batch's figures as they come) reuses its graphs."""
    import torch

    return torch.compile(fn, fullgraph=True, dynamic=False)


def in_place_inputs(batch: int, length: int, max_len: int, device: Any, dtype: Any) -> tuple[tuple, tuple]:
    """The gathered attention's arguments and the in-place one's, for `batch` rows each in its
    own slot of a `kv.SlotKV`-laid cache (`max_len` positions a slot, random), each row at its
    own position up to `length` - 1; marked dynamic as `GATHER_DYNAMIC` and `IN_PLACE_DYNAMIC` say."""
    import torch

    from vox_ws.engines.voxcpm.graphs import mark_dynamic
    from vox_ws.engines.voxcpm.kv import slot_positions

    stored = (KV_HEADS, batch + 1, slot_positions(max(max_len, length)), HEAD_DIM)
    generator = torch.Generator(device="cpu").manual_seed(batch)
    cache_k = torch.randn(stored, generator=generator).to(device, dtype).transpose(0, 1)
    cache_v = torch.randn(stored, generator=generator).to(device, dtype).transpose(0, 1)
    slots = torch.randperm(batch, generator=generator).to(device)
    q, _, _, mask = inputs(batch, length, device, dtype)
    positions = mask.view(batch, length).sum(dim=1) - 1
    gather_args = (q, cache_k, cache_v, slots, positions, torch.arange(length, device=device))
    in_place_args = (q.clone(), cache_k, cache_v, torch.stack((slots, positions), dim=1))
    mark_dynamic(_gather_attention, gather_args, GATHER_DYNAMIC)
    mark_dynamic(_in_place_attention, in_place_args, IN_PLACE_DYNAMIC)
    return gather_args, in_place_args


def in_place_rows(device: str, dtype: str, batches: list[int], lengths: list[int], max_len: int,
                  repeats: int = 20) -> list[dict]:
    """Per batch and length: the compiled gather + `attend` against the compiled in-place
    attention, their largest difference, and the kernel inductor's CUDA lowering takes for the
    in-place graph's shapes (`flex_kernels.kernels_of`; on a GPU, what it took, where it compiled
    the graph here)."""
    import torch

    from vox_ws.engines.voxcpm.flex_kernels import kernels_of, lowered, summary

    device_, dtype_ = torch.device(device), getattr(torch, dtype)
    gather, in_place = _compiled(_gather_attention), _compiled(_in_place_attention)
    rows = []
    with torch.inference_mode():
        for batch in batches:
            for length in lengths:
                gather_args, in_place_args = in_place_inputs(batch, length, max_len, device_, dtype_)
                with lowered() as chosen:
                    difference = (gather(*gather_args).float() - in_place(*in_place_args).float()).abs().max()
                rows.append({"batch": batch, "length": length,
                             "gather_ms": round(time_ms(gather, gather_args, device_, repeats), 4),
                             "in_place_ms": round(time_ms(in_place, in_place_args, device_, repeats), 4),
                             "max_abs_diff": float(difference),
                             "kernel": summary(kernels_of(_in_place_attention, in_place_args, IN_PLACE_DYNAMIC)),
                             **({"lowered": summary(chosen)} if chosen else {})})
                del gather_args, in_place_args
            if device_.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def in_place_table(rows: list[dict]) -> list[str]:
    """The rows of `in_place_rows` as a table; the kernel column is what inductor's CUDA lowering
    takes for the in-place graph (and, where it compiled it here, what it took)."""
    lines = [f"{'B':>3} {'length':>6} {'gather+SDPA ms':>15} {'in place ms':>12} {'in place/gather':>16} "
             f"{'max diff':>9}  kernel on CUDA"]
    for r in rows:
        kernel = r.get("kernel", "?") + (f" (lowered: {r['lowered']})" if "lowered" in r else "")
        lines.append(f"{r['batch']:>3} {r['length']:>6} {r['gather_ms']:>15.3f} {r['in_place_ms']:>12.3f} "
                     f"{r['in_place_ms'] / r['gather_ms']:>16.2f} {r['max_abs_diff']:>9.1e}  {kernel}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--lengths", default="100,1000")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--gather", action="store_true", help="the KV gather against the attention after it")
    ap.add_argument("--in-place", action="store_true",
                    help="the compiled gather + attention against the compiled in-place attention")
    ap.add_argument("--max-len", type=int, default=8192, help="positions a KV slot holds (--gather, --in-place)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.in_place:
        rows = in_place_rows(args.device, args.dtype, [int(b) for b in args.batches.split(",")],
                             [int(n) for n in args.lengths.split(",")], args.max_len, args.repeats)
        print(f"# the compiled decode attention, gathered against in place, {HEADS} query heads over {KV_HEADS} "
              f"KV heads of {HEAD_DIM}: {args.device}, {args.dtype}, {args.threads} thread(s), median of "
              f"{args.repeats}")
        print("\n".join(in_place_table(rows)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": args.device, "dtype": args.dtype, "in_place": rows}, f, indent=1)
        return 0
    if args.gather:
        rows = gather_rows(args.device, args.dtype, [int(b) for b in args.batches.split(",")],
                           [int(n) for n in args.lengths.split(",")], args.max_len, args.repeats)
        print(f"# the decode's KV gather (K and V) against the attention after it: {args.device}, {args.dtype}, "
              f"{args.threads} thread(s), median of {args.repeats}")
        print(f"{'B':>3} {'length':>6} {'gather ms':>10} {'attend ms':>10} {'gather/attend':>14}")
        for r in rows:
            print(f"{r['batch']:>3} {r['length']:>6} {r['gather_ms']:>10.3f} {r['attend_ms']:>10.3f} "
                  f"{r['gather_ms'] / r['attend_ms']:>14.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": args.device, "dtype": args.dtype, "gather": rows}, f, indent=1)
        return 0
    rows = run(args.device, args.dtype, [int(b) for b in args.batches.split(",")],
               [int(n) for n in args.lengths.split(",")], args.repeats)
    print(f"# decode attention, {HEADS} query heads over {KV_HEADS} KV heads of {HEAD_DIM}: {args.device}, "
          f"{args.dtype}, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'B':>3} {'length':>6} {'before ms':>10} {'after ms':>9} {'after/before':>13} "
          f"{'kernels':>32} {'max diff':>9}")
    for r in rows:
        print(f"{r['batch']:>3} {r['length']:>6} {r['before_ms']:>10.3f} {r['after_ms']:>9.3f} "
              f"{r['after_ms'] / r['before_ms']:>13.2f} {r['before_kernel'] + ' -> ' + r['after_kernel']:>32} "
              f"{r['max_abs_diff']:>9.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "dtype": args.dtype, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
