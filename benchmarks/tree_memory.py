"""A command's process tree's peak memory: the summed PSS (each shared page counted once, split
among the processes that share it) and RSS of the command and every process under it, sampled
every half second, with its wall time.

    python -m benchmarks.tree_memory -- scripts/test.sh --quick

What CONTRIBUTING.md's figure for the quick lane comes from.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import psutil

SAMPLE_EVERY_S = 0.5


def tree_memory(process: psutil.Process) -> tuple[int, int, int]:
    """PSS and RSS in bytes of `process` and all under it, and how many processes that is."""
    pss = rss = count = 0
    try:
        processes = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0, 0, 0
    for each in processes:
        try:
            memory = each.memory_full_info()
        except psutil.Error:                      # ended between the listing and the reading
            continue
        pss, rss, count = pss + memory.pss, rss + memory.rss, count + 1
    return pss, rss, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name a command to run, after --")
    started = time.monotonic()
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    peak_pss = peak_rss = peak_count = 0
    while child.poll() is None:
        pss, rss, count = tree_memory(root)
        peak_pss, peak_rss, peak_count = max(peak_pss, pss), max(peak_rss, rss), max(peak_count, count)
        time.sleep(SAMPLE_EVERY_S)
    print(f"exit {child.returncode}, {time.monotonic() - started:.0f} s, peak PSS {peak_pss / 1e9:.2f} GB, "
          f"peak RSS {peak_rss / 1e9:.2f} GB, at most {peak_count} processes")
    raise SystemExit(child.returncode)


if __name__ == "__main__":
    main()
