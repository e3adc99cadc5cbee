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
check="import vox_ws, piper"
[[ ",$extras," == *",voxcpm,"* ]] && check="$check, voxcpm"
if ! .venv/bin/python -c "$check" 2>/dev/null; then
  VOX_WS_EXTRAS="$extras" scripts/setup.sh
fi
exec .venv/bin/vox-ws serve "$@"
