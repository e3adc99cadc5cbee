#!/usr/bin/env bash
# Set up (first run only) and start the server on its default engine (`auto`: VoxCPM2 with a GPU
# and its weights, else the Piper CPU voice). Extra arguments go to `vox-ws serve`, e.g.
#   scripts/serve.sh --host 0.0.0.0 --port 8765
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${VOX_WS_EXTRAS:-piper}"
# With an NVIDIA GPU, also install the VoxCPM2 engine so that `auto` can choose it.
if [ -z "${VOX_WS_EXTRAS:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then
  extras="piper,voxcpm"
fi
# Set up when .venv lacks anything the extras named need (a package, its version, vox-ws itself):
# scripts/missing_extras.py reads them from pyproject.toml and says which (adding one, such as
# VOX_WS_EXTRAS=piper,wyoming for Home Assistant, installs it), or refuses an extra there is not.
missing=1
if [ -x .venv/bin/python ]; then
  missing=0
  .venv/bin/python scripts/missing_extras.py "$extras" >&2 || missing=$?
fi
if [ "$missing" = 2 ]; then
  exit 2
fi
if [ "$missing" != 0 ]; then
  VOX_WS_EXTRAS="$extras" scripts/setup.sh
fi
exec .venv/bin/vox-ws serve "$@"
