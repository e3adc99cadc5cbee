#!/usr/bin/env bash
# Install everything the tests need (system packages, the venv with every extra) and run them all.
set -euo pipefail
cd "$(dirname "$0")/.."
VOX_WS_EXTRAS=piper,voxcpm,test scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
exec .venv/bin/python -m pytest "$@"
