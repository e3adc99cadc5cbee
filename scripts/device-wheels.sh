#!/usr/bin/env bash
# The wheels the device check needs that the lent GPU machine's image lacks (it has Python 3.12,
# torch, Triton, numpy, safetensors, huggingface_hub, transformers, tokenizers, msgpack, uvloop,
# scipy, scikit-learn, numba, and no network), downloaded here into .whl/ (ignored by git) for
# Python 3.12 on x86-64 Linux, at the versions this project's .venv tests. Then, on the device:
#   python3 -m benchmarks.device_check --out "$OUT"      (the run carries .whl and installs it)
# A --device cuda run that finds no wheels in .whl fails in its first seconds, before any model load.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
[ -x "$python" ] || { echo "run scripts/setup.sh with the voxcpm extra first (its versions are pinned here)" >&2; exit 2; }
# The list is benchmarks/device_stack.py's WHEELS (voxcpm and what it imports, what vox-ws imports
# on the engine's path, and their own dependencies): the same list the CI test blocks against.
mapfile -t packages < <("$python" -m benchmarks.device_stack --wheels)
pins=()
for package in "${packages[@]}"; do
  version="$("$python" -c 'import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))' "$package")"
  pins+=("$package==$version")
done
rm -rf .whl
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$python" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl "${pins[@]}"
du -sh .whl | awk '{print "wheels for the device in .whl: " $1}' >&2
