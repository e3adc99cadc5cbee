#!/usr/bin/env bash
# The device check, ready for the day a GPU is lent: on a bare CUDA machine with PyTorch and no
# network, build a random-weight VoxCPM2 of the real size and run, in one call (--parts to choose):
#   equivalence  the batched loop against the voxcpm package on CUDA in float32 and bfloat16 (in
#                float32 also rows with different LoRA adapters in one batch, each against the
#                package with only its adapter)                               expected ~3 min
#   scheduler    the scheduler benchmark at N = 1, 8, 32, 64 (throughput, first audio, step
#                time, memory)                                                 expected ~1.5 min
#   compiled     the compiled step against eager (`benchmarks.compiled`: step times at B = 1, 8,
#                32, compiled for those sizes only; the engine's start eager, compiled with an
#                empty cache, and again loading its graphs)                    expected ~3 min
#   capacity     open-loop capacity (`benchmarks.capacity`), deadline-aware batching eager
#                against compiled, 64 slots and 32 rows a step, 10 s at each of 4, 8, 16
#                arrivals a second                                             expected ~2.5 min
# The expected durations are estimates for an H100-class GPU (none has been lent yet): if the
# whole does not fit one 10-minute call, run it as two (--parts equivalence,scheduler, then
# --parts compiled,capacity). Writes OUT/gpu-check.json and OUT/gpu-check.txt, with
# nanovllm-voxcpm's published figures beside. On a CPU, end to end with the tiny model (what
# CI-less sessions run; the capacity part then runs eager, briefly):
#
#   scripts/gpu-check.sh --device cpu --size tiny --out /tmp/gpu-check
#
# Missing Python packages travel as wheels in .whl/ (see the device tool's README); they are
# installed into /tmp/site first. vox-ws itself runs from this tree, uninstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
device=cuda size=real out="${OUT:-gpu-check-out}" concurrency="1,8,32,64" parts="equivalence,scheduler,compiled,capacity"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --size) size="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --concurrency) concurrency="$2"; shift 2 ;;
    --parts) parts="$2"; shift 2 ;;
    *) echo "usage: $0 [--device cuda|cpu] [--size real|tiny] [--out DIR] [--concurrency 1,8,32,64]" \
            "[--parts equivalence,scheduler,compiled,capacity]" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ "$device" = cpu ] && python=.venv/bin/python
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$SECONDS
dtypes="float32"
[ "$device" != cpu ] && dtypes="float32 bfloat16"     # bfloat16 on a CPU is not what serves there

wants() { [[ ",$parts," == *",$1,"* ]]; }

for dtype in $dtypes; do
  echo "== building a $size VoxCPM2 ($dtype)" >&2
  "$python" -m vox_ws.testing.tiny_voxcpm "$work/$dtype" --size "$size" --dtype "$dtype" >&2
  wants equivalence || continue
  echo "== equivalence: batched loop vs the package, $device, $dtype" >&2
  loras=""
  [ "$dtype" = float32 ] && loras="--loras"
  "$python" -m benchmarks.equivalence --model "$work/$dtype" --device "$device" $loras \
    --json "$out/equivalence-$dtype.json" >&2 || true      # the figures say whether it held
done
if wants scheduler; then
  echo "== scheduler benchmark at N = $concurrency ($device, float32)" >&2
  "$python" -m benchmarks.scheduler --model "$work/float32" --device "$device" --concurrency "$concurrency" \
    --rounds 1 --min-steps 10 --max-steps 20 --json "$out/scheduler.json" | tee "$out/scheduler.txt" >&2
fi
if wants compiled; then
  compiled_batches="1,8,32"
  [ "$device" = cpu ] && compiled_batches="1,4"          # a CPU compiles slowly: a short check
  echo "== compiled step vs eager at B = $compiled_batches ($device, float32)" >&2
  "$python" -m benchmarks.compiled --model "$work/float32" --device "$device" --batches "$compiled_batches" \
    --buckets "$compiled_batches" --steps 10 --repeats 2 --json "$out/compiled.json" | tee "$out/compiled.txt" >&2
fi
if wants capacity; then
  configurations="voxcpm-deadline,voxcpm-deadline-compiled" rates="4,8,16" seconds=10
  [ "$device" = cpu ] && configurations="voxcpm-deadline" rates="2" seconds=4   # compiling: minutes here
  echo "== open-loop capacity: $configurations at $rates arrivals/s ($device, float32)" >&2
  "$python" -m benchmarks.capacity --model "$work/float32" --device "$device" --configurations "$configurations" \
    --rates "$rates" --seconds "$seconds" --json "$out/capacity.json" | tee "$out/capacity.txt" >&2
fi

"$python" - "$out" "$dtypes" "$device" "$size" "$((SECONDS - started))" <<'PY'
import json, os, sys
out, dtypes, device, size, seconds = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4], int(sys.argv[5])


def part(name):
    path = f"{out}/{name}.json"
    return json.load(open(path)) if os.path.exists(path) else None


equivalence = {d: e for d in dtypes if (e := part(f"equivalence-{d}")) is not None}
scheduler, compiled, capacity = part("scheduler"), part("compiled"), part("capacity")
report = {"device": device, "size": size, "seconds": seconds, "equivalence": equivalence,
          "scheduler": scheduler["results"] if scheduler else None, "compiled": compiled, "capacity": capacity}
json.dump(report, open(f"{out}/gpu-check.json", "w"), indent=1)
lines = [f"vox-ws device check: {device}, {size} model, {seconds} s"]
if equivalence:
    lines += ["", "equivalence (batched loop vs the package, largest |difference| per request):"]
for d, e in equivalence.items():
    lines.append(f"  {d:9s} {'equal' if e['equal'] else 'DIFFERENT'} (tolerance {e['tolerance']:g}): "
                 + ", ".join(f"{x:.2e}" for x in e["max_abs_diff"]))
    if "loras" in e:
        l = e["loras"]
        lines.append(f"  {'LoRA':9s} {'equal' if l['equal'] else 'DIFFERENT'} (adapters {l['plan']} in one batch, "
                     f"each changing its audio: {l['adapters_change_audio']}): "
                     + ", ".join(f"{x:.2e}" for x in l["max_abs_diff"]))
if scheduler:
    lines += ["", f"{'N':>3} {'audio s/s':>10} {'x serial':>9} {'ttfa p50':>9} {'ttfa p95':>9} {'step ms':>8} "
              f"{'memory MB':>10}"]
    for r in scheduler["results"]:
        b = r["batched"]
        memory = b.get("peak_gpu_mb", b.get("peak_rss_mb"))
        lines.append(f"{r['n']:>3} {b['throughput']:>10.2f} {r['ratio']:>9.2f} {b['ttfa_p50_ms']:>7.0f}ms "
                     f"{b['ttfa_p95_ms']:>7.0f}ms {b['mean_step_ms']:>8.1f} {memory:>10.0f}")
if compiled:
    lines += ["", f"{'B':>3} {'eager ms':>9} {'compiled ms':>12} {'compiled/eager':>15}"]
    for r in compiled["steps_ms"]:
        lines.append(f"{r['batch']:>3} {r['eager_ms']:>9.2f} {r['compiled_ms']:>12.2f} {r['compiled_vs_eager']:>15.3f}")
    st = compiled["starts"]
    lines.append(f"start: eager {st['eager_s']} s, compiled first {st['compiled_first_s']} s, second "
                 f"{st['compiled_second_s']} s")
if capacity:
    lines += ["", f"{'configuration':26s} {'arrivals/s':>10} {'ttfa p50':>9} {'ttfa p95':>9} {'gap-free':>9} "
              f"{'listeners':>10}"]
    for label, result in capacity.items():
        for r in result["rates"]:
            lines.append(f"{label:26s} {r['rate_per_s']:>10g} {r['first_audio_ms']['p50']:>7.0f}ms "
                         f"{r['first_audio_ms']['p95']:>7.0f}ms {100 * (r['gap_free_share'] or 0):>8.1f}% "
                         f"{r['concurrent_listeners']:>10.1f}")
        held = result["capacity"]
        lines.append(f"{label:26s} capacity: " + (f"{held['rate_per_s']:g} arrivals/s, {held['concurrent_listeners']:.1f} "
                                                 "listeners" if held else "none of these rates"))
lines += ["", "published (nanovllm-voxcpm, RTX 4090, VoxCPM2): first audio p50 67 ms at 1 stream, 114 ms at 32, "
          "189 ms at 64"]
open(f"{out}/gpu-check.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
