#!/usr/bin/env bash
# The full suite five times, as issue 20 asks, in a clean clone of this checkout's HEAD:
#   1. CI=true bash .ci/run (a fresh venv, as CI does)     2-3. scripts/test.sh -q -rs
#   4. taskset -c 0 beside a busy loop on core 1            5. a busy loop on each core
# Logs and a line per run go to DIR (default /tmp/vox-ws-prove); one run:  scripts/prove-suite.sh DIR 4
# About 15 + 15 + 15 + 13 + 27 minutes on the 2-core development machine. Run nothing else that
# uses pytest meanwhile; to stop it, end its whole process group (kill -- -PGID): killing the
# script alone leaves the run's pytest going.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-/tmp/vox-ws-prove}"
only="${2:-}"
clone="$out/clone"
mkdir -p "$out"
if [ ! -d "$clone" ]; then
  git clone -q "$here" "$clone"
fi
cd "$clone"

hogs=()
hog() { taskset -c "$1" python3 -c "while True: pass" & hogs+=($!); }
unhog() { for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done; hogs=(); }
trap unhog EXIT

run() {
  local n=$1 what=$2 started rc
  shift 2
  started=$(date +%s)
  # A temporary directory of the run's own: pytest deletes all but its three newest base
  # directories, so another pytest session on the machine would delete this one's files.
  rm -rf "$out/tmp$n" && mkdir -p "$out/tmp$n"
  TMPDIR="$out/tmp$n" "$@" > "$out/run$n.log" 2>&1
  rc=$?
  unhog
  echo "run $n ($what) at $(git rev-parse --short HEAD): exit $rc in $(( $(date +%s) - started )) s: $(tail -1 "$out/run$n.log")" \
    | tee -a "$out/results.txt"
}

for n in 1 2 3 4 5; do
  [ -n "$only" ] && [ "$only" != "$n" ] && continue
  case $n in
    1) run 1 "CI=true .ci/run" env CI=true bash .ci/run ;;
    2|3) run "$n" "plain" scripts/test.sh -q -rs ;;
    4) hog 1; run 4 "one core beside a busy loop" taskset -c 0 scripts/test.sh -q -rs ;;
    5) hog 0; hog 1; run 5 "a busy loop on each core" scripts/test.sh -q -rs ;;
  esac
done
