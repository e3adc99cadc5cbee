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
fewer than the container's CPUs where the server has more: the server's streams, and a busy
machine's other work, come first; inductor compiles with a worker per CPU of the container.

Where an earlier run with the same settings, code and versions put every graph in the cache and
they are all still there (`CacheRecord`), it loads no model: it says each event at once, with
`"cached": true` (and the timings that run measured).

    python -m vox_ws.engines.voxcpm.compile_main '{"model": DIR, "device": ..., "buckets": [...], ...}'
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ...priority import lowest_priority
from ..child import killed_with_parent
from ..cpus import cpu_limit
from .compile_workers import compile_workers, use_compile_workers

# The events go to the standard output this process was given; everything else printed here (the
# package prints as it loads) goes to the standard error, where the server's log is.
_events = sys.stdout


def say(event: str, **fields: Any) -> None:
    _events.write(json.dumps({"event": event, **fields}) + "\n")
    _events.flush()


def load_model(settings: dict[str, Any]) -> Any:
    """The server's model, loaded as the server loaded it (its LoRA layers, without slots)."""
    from .loading import from_pretrained, import_voxcpm

    import_voxcpm()
    lora_config = None
    if settings.get("lora_rank"):
        from voxcpm.model.voxcpm2 import LoRAConfig

        lora_config = LoRAConfig(enable_lm=True, enable_dit=True, enable_proj=False, r=settings["lora_rank"],
                                 alpha=settings["lora_alpha"])
    return from_pretrained(settings["model"], load_denoiser=False, optimize=False, device=settings["device"],
                           lora_config=lora_config).tts_model


def compile_all(settings: dict[str, Any], load: Callable[[dict[str, Any]], Any] = load_model) -> bool:
    """Every bucket's graphs and the decode's in the cache, each said as it is there; True where
    they all were already (`CacheRecord`), and no model was loaded (`load`)."""
    import torch

    torch.set_num_threads(compile_threads(settings.get("threads") or 1))
    buckets = tuple(settings["buckets"])
    measure = settings.get("measure", False)
    record = CacheRecord(settings)
    found = None if settings.get("fresh") else record.read(measured=measure)
    if found is not None:
        print("background compile: every graph is in the compile cache already; no model loaded",
              file=sys.stderr)
        for rows in buckets:
            say("bucket", rows=rows, seconds=0.0, cached=True, **(found[str(rows)] if measure else {}))
        say("decode", seconds=0.0, cached=True)
        return True

    from .attention_choice import take_choice
    from .compiled import CompiledStep, untimed_kernels
    from .lora import NO_ADAPTER, install_row_lora
    from .prompt import build_prompt
    from .runner import BatchedVoxCPM2

    if str(settings["device"]).startswith("cuda"):
        # Its graphs first run beside the serving process: no kernel may be timed there.
        untimed_kernels()
    model = load(settings)
    adapters = (install_row_lora(model, settings["max_loras"], settings["lora_rank"])[0]
                if settings.get("lora_rank") else None)
    # As the server's runner decodes in this process's place: the same VAE settings, so that the
    # decode's graphs are the ones it will look for.
    runner = BatchedVoxCPM2(model, slots=max(buckets) if measure else 1, decode_process=False,
                            warm_rows=1, adapters=adapters)
    if settings.get("in_place") is not None:        # as the server attends (it probed, where it does)
        take_choice(settings["device"], settings["in_place"])
    compiled = CompiledStep(model, buckets, settings["cache"], adapters=adapters)
    graphs = record.watch(compiled.store)
    prompt = build_prompt(model, "Timing the step, eager and compiled.", None)
    measured = {}
    for rows in buckets:
        started = time.perf_counter()
        compiled.warm_up(runner.base_kv, runner.residual_kv, (rows,))
        seconds = time.perf_counter() - started
        measured[str(rows)] = (time_eager_and_compiled(runner, compiled, prompt, rows, NO_ADAPTER) if measure
                               else {})
        say("bucket", rows=rows, seconds=round(seconds, 2), **measured[str(rows)])
    started = time.perf_counter()
    runner.vae.compile(buckets, model.patch_size, compiled.store)
    say("decode", seconds=round(time.perf_counter() - started, 2))
    if compiled.store.precompile:       # else nothing was kept: the next start compiles again
        record.write(graphs, measured)
    return False


class CacheRecord:
    """What a run that put every graph in the cache leaves there, so that the next one with the
    same settings need not load the model to find them there (a model of some GB, on the GPU the
    server serves from): the graphs' files and the timings it measured, in
    `CACHE/complete/KEY.json`. The key names what a graph's own key is made of that can be known
    without the model (`graphs.GraphStore`): the versions of Python, PyTorch, voxcpm and vox-ws,
    the source of every module of this engine, the checkpoint's config.json, the settings given
    (the model, device, threads, buckets and LoRA slots; the GPU's name and architecture). A
    record whose graphs are not all there any more is not used; a server that fails to load one
    it names starts a compile that does not read records (`"fresh"`)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from .cache_trust import trusted_cache_dir

        self.directory = trusted_cache_dir(Path(settings["cache"])) / "complete"
        self.path = self.directory / f"{record_key(settings)}.json"

    def read(self, measured: bool) -> dict[str, dict[str, float]] | None:
        """The timings of each bucket (by its rows, as text) where every graph the record names is
        in the cache (and, where `measured`, it has each bucket's timings); else None."""
        graphs = self.directory.parent / "graphs"       # where `graphs.GraphStore` keeps them
        try:
            record = json.loads(self.path.read_text())
            there = bool(record["graphs"]) and all(Path(name).name == name and (graphs / name).is_file()
                                                   for name in record["graphs"])
            timings = record["measured"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not there or (measured and not all(timings.get(str(rows)) for rows in record["buckets"])):
            return None
        return timings

    @staticmethod
    def watch(store: Any) -> list[str]:
        """The names of the files of the graphs `store` loads or compiles from now on (the list
        returned grows as it does)."""
        names: list[str] = []
        path = store.path

        def recorded(*args: Any, **kwargs: Any) -> Path:
            found = path(*args, **kwargs)
            if found.name not in names:
                names.append(found.name)
            return found
        store.path = recorded
        return names

    def write(self, graphs: list[str], measured: dict[str, dict[str, float]]) -> None:
        """Record `graphs` (their files' names) and each bucket's timings (`{}`: not measured)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"graphs": graphs, "measured": measured,
                                       "buckets": sorted(int(rows) for rows in measured)}))
        os.replace(partial, self.path)     # whole or absent


def record_key(settings: dict[str, Any]) -> str:
    """What `CacheRecord`'s key is made of (see there), digested."""
    import hashlib
    import importlib.metadata
    import platform

    import torch

    from ... import __version__
    from .loading import read_config

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "-"
    digest = hashlib.sha256()
    given = {k: v for k, v in settings.items() if k not in ("parent", "cache", "measure", "fresh")}
    digest.update(json.dumps(given, sort_keys=True).encode())
    digest.update(f"{sys.version} {platform.machine()} torch {torch.__version__} cuda {torch.version.cuda} "
                  f"triton {version('triton')} voxcpm {version('voxcpm')} vox-ws {__version__}".encode())
    if str(settings["device"]).startswith("cuda"):
        device = torch.device(settings["device"])
        gpu = f"{torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}"
        digest.update(gpu.encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + source.read_bytes())
    digest.update(json.dumps(read_config(Path(settings["model"])), sort_keys=True).encode())
    return digest.hexdigest()[:32]


def time_eager_and_compiled(runner: Any, compiled: Any, prompt: Any, rows: int,
                            no_adapter: int) -> dict[str, float]:
    """One step of `rows` rows, eager and compiled (the median of 5 after 2 each, the decode
    eager in both): which is the faster on this device. Each step timed from a synchronised
    device to a synchronised one: a GPU's step is queued before it is done, and queueing is
    what a compiled step saves most of."""
    import torch

    from .runner import PrefillInput

    def synchronised() -> None:
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)

    timings = {}
    for name, step in (("eager_ms", None), ("compiled_ms", compiled)):
        runner.compiled = step
        batch = runner.prefill_many([PrefillInput(prompt, seed=i, cfg_value=2.0, timesteps=10, min_len=100,
                                                  max_len=4096, adapter=no_adapter) for i in range(rows)])
        samples = []
        for index in range(7):
            synchronised()
            started = time.perf_counter()
            runner._generate(batch)
            synchronised()
            if index >= 2:
                samples.append((time.perf_counter() - started) * 1000)
        for row in batch:
            runner.release(row)
        timings[name] = round(sorted(samples)[len(samples) // 2], 3)
    runner.compiled = None
    return timings


def compile_threads(server_threads: int) -> int:
    """The compile's torch threads: the server's, leaving it one of the container's CPUs of its
    own at least."""
    return max(1, min(server_threads, cpu_limit() - 1))


def _exit_with_parent() -> None:
    sys.stdin.read()
    os._exit(0)


def main() -> None:
    global _events
    settings = json.loads(sys.argv[1])
    # Before anything imports inductor: its compile workers, one per CPU this container may use
    # (or as the server was told), not per CPU of the host.
    use_compile_workers(compile_workers())
    killed_with_parent()
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
        cached = compile_all(settings)
    except Exception as exc:  # noqa: BLE001 - the server serves eager, and says why
        say("failed", error=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from exc
    say("done", cached=cached)


if __name__ == "__main__":
    main()
