#!/usr/bin/env bash
# Set up (first run only) and start the server on its default engine. Extra arguments go to
# `vox-ws serve`, e.g. scripts/serve.sh --host 0.0.0.0 --port 8765
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import vox_ws, piper" 2>/dev/null; then
  VOX_WS_EXTRAS="${VOX_WS_EXTRAS:-piper}" scripts/setup.sh
fi
exec .venv/bin/vox-ws serve "$@"
