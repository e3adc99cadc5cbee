"""The background compile: a process of its own that loads the model as the server did and
compiles the step's graphs into the server's compile cache, bucket by bucket, while the server
serves eager (`background.BackgroundCompile` starts it and reads what it says).

It says one JSON line on its standard output per event: `{"event": "started", "priority"}` once it
will die with the server and runs at its priority, `{"event": "bucket", "rows", "seconds",
"eager_ms", "compiled_ms"}` when a bucket's graphs are in the cache (with, where asked, one step of
that many rows timed eager and compiled here: a CPU's compiled step is not always the faster),
`{"event": "decode", "seconds"}` when the decode's graphs are, then `{"event": "done"}`; or
`{"event": "failed", "error"}`. Its KV caches have as few slots as a bucket needs: the graphs take
any number of slots. It runs on idle CPU time only (`priority.lowest_priority`), with one thread
fewer than the cores where the server has more: the server's streams, and a busy machine's other
work, come first.

    python -m vox_ws.engines.voxcpm.compile_main '{"model": DIR, "device": ..., "buckets": [...], ...}'
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from ...priority import lowest_priority

# The events go to the standard output this process was given; everything else printed here (the
# package prints as it loads) goes to the standard error, where the server's log is.
_events = sys.stdout


def say(event: str, **fields: Any) -> None:
    _events.write(json.dumps({"event": event, **fields}) + "\n")
    _events.flush()


def compile_all(settings: dict[str, Any]) -> None:
    import torch

    from .compiled import CompiledStep
    from .loading import import_voxcpm
    from .lora import NO_ADAPTER, install_row_lora
    from .prompt import build_prompt
    from .runner import BatchedVoxCPM2

    torch.set_num_threads(compile_threads(settings.get("threads") or 1))
    lora_config = None
    if settings.get("lora_rank"):
        from voxcpm.model.voxcpm2 import LoRAConfig

        lora_config = LoRAConfig(enable_lm=True, enable_dit=True, enable_proj=False, r=settings["lora_rank"],
                                 alpha=settings["lora_alpha"])
    tts = import_voxcpm().VoxCPM.from_pretrained(settings["model"], load_denoiser=False, optimize=False,
                                                 device=settings["device"], lora_config=lora_config)
    model = tts.tts_model
    adapters = install_row_lora(model, settings["max_loras"], settings["lora_rank"])[0] if lora_config else None
    buckets = tuple(settings["buckets"])
    measure = settings.get("measure", False)
    # As the server's runner decodes in this process's place: the same VAE settings, so that the
    # decode's graphs are the ones it will look for.
    runner = BatchedVoxCPM2(model, slots=max(buckets) if measure else 1, decode_process=False,
                            warm_rows=1, adapters=adapters)
    compiled = CompiledStep(model, buckets, settings["cache"], adapters=adapters)
    prompt = build_prompt(model, "Timing the step, eager and compiled.", None)
    for rows in buckets:
        started = time.perf_counter()
        compiled.warm_up(runner.base_kv, runner.residual_kv, (rows,))
        seconds = time.perf_counter() - started
        timings = time_eager_and_compiled(runner, compiled, prompt, rows, NO_ADAPTER) if measure else {}
        say("bucket", rows=rows, seconds=round(seconds, 2), **timings)
    started = time.perf_counter()
    runner.vae.compile(buckets, model.patch_size, compiled.store)
    say("decode", seconds=round(time.perf_counter() - started, 2))


def time_eager_and_compiled(runner: Any, compiled: Any, prompt: Any, rows: int,
                            no_adapter: int) -> dict[str, float]:
    """One step of `rows` rows, eager and compiled (the median of 5 after 2 each, the decode
    eager in both): which is the faster on this device."""
    from .runner import PrefillInput

    timings = {}
    for name, step in (("eager_ms", None), ("compiled_ms", compiled)):
        runner.compiled = step
        batch = runner.prefill_many([PrefillInput(prompt, seed=i, cfg_value=2.0, timesteps=10, min_len=100,
                                                  max_len=4096, adapter=no_adapter) for i in range(rows)])
        samples = []
        for index in range(7):
            started = time.perf_counter()
            runner._generate(batch)
            if index >= 2:
                samples.append((time.perf_counter() - started) * 1000)
        for row in batch:
            runner.release(row)
        timings[name] = round(sorted(samples)[len(samples) // 2], 3)
    runner.compiled = None
    return timings


def compile_threads(server_threads: int) -> int:
    """The compile's torch threads: the server's, leaving it one core of its own at least."""
    return max(1, min(server_threads, (os.cpu_count() or 1) - 1))


def _exit_with_parent() -> None:
    sys.stdin.read()
    os._exit(0)


def _killed_with_parent() -> None:
    """On Linux, the kernel kills this process (SIGKILL: also when it is stopped, or stuck where
    no thread reads its standard input) as soon as the server that started it is gone."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


def main() -> None:
    global _events
    settings = json.loads(sys.argv[1])
    _killed_with_parent()
    if os.getppid() != settings.get("parent", os.getppid()):    # the server went before that took effect
        os._exit(0)
    _events = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    priority = lowest_priority()
    say("started", priority=priority)
    os.environ.setdefault("TQDM_DISABLE", "1")
    # The server holds this process's standard input open: when it ends (a crash, a kill), so
    # does this compile, rather than go on alone.
    threading.Thread(target=_exit_with_parent, name="parent-watch", daemon=True).start()
    try:
        compile_all(settings)
    except Exception as exc:  # noqa: BLE001 - the server serves eager, and says why
        say("failed", error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from exc
    say("done")


if __name__ == "__main__":
    main()
