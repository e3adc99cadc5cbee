#!/usr/bin/env bash
# Install everything the tests need (system packages, the venv with every extra) and run them all.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: Debian's Chromium for the browser test (Playwright drives it; it never
# downloads a browser of its own), Node.js for the demo's JavaScript unit tests, redis-server
# and HAProxy for the replica tests.
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v node >/dev/null 2>&1 || missing+=(nodejs)
# Real servers for the scale-out tests: Redis (the shared voice store) and HAProxy (replicas).
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

VOX_WS_EXTRAS=piper,voxcpm,test,pipecat,livekit,wyoming scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
exec .venv/bin/python -m pytest "$@"
