"""`vox-ws compile`: the step compiled into the compile cache ahead of time, then exit; for an
image build, a Kubernetes Job or an init container, so that every start after it loads the graphs
in seconds instead of compiling them for minutes (in the background, beside the streams it
serves).

It takes `serve`'s options, and must be given the ones the server will run with: the model, the
device, `--slots` and `--step-rows` (which decide the buckets), `--lora-rank` and `--max-loras`,
`--compile-buckets` and `--compile-cache`. It compiles every bucket whatever `--compile` says
but off (`auto` on a CPU later uses only the buckets it measures faster), with one compiler
process per CPU the container may use (its cgroup's CPU quota), or TORCHINDUCTOR_COMPILE_THREADS.
"""

from __future__ import annotations

import sys
import time

from .. import engines
from ..config import ServerConfig
from ..engine_process.devices import parse_devices
from ..engines.voxcpm.compile_workers import compile_workers, use_compile_workers

# The engines with a compiled step.
COMPILES = ("voxcpm",)


def compile_ahead(config: ServerConfig) -> int:
    """Compile into the cache for each device of `config`; the exit status (0: every graph is in
    the cache, loaded or compiled here)."""
    name = "voxcpm" if config.engine == "auto" else config.engine
    if name not in COMPILES:
        print(f"vox-ws compile: the {name} engine has no compiled step (only {', '.join(COMPILES)})", file=sys.stderr)
        return 2
    if config.engine_settings.get("compile") == "off":
        print("vox-ws compile: --compile off: a server started so compiles nothing, so there is nothing to compile",
              file=sys.stderr)
        return 2
    # Before anything imports inductor: one compile worker per CPU this container may use (or as
    # many as TORCHINDUCTOR_COMPILE_THREADS says), not one per CPU of the host.
    use_compile_workers(compile_workers())
    settings = {**config.engine_options(), "compile": "on", "compile_wait": True}
    for device in parse_devices(config.device):
        engine = engines.create_engine(name, {**settings, "device": device})
        started = time.perf_counter()
        try:
            engine.load()
            info = engine.describe()["compile"]
            cache = engine.compiled.cache_dir if engine.compiled is not None else None
        finally:
            engine.close()
        seconds = time.perf_counter() - started
        if not info["precompile"]:
            print("vox-ws compile: this torch cannot save compiled graphs (no precompile): a server compiles "
                  "them at every start; nothing was kept", file=sys.stderr)
            return 1
        graphs = info["graphs"]
        print(f"{engine.device}: the step for {info['buckets']} rows in {cache}: {graphs['compiled']} graphs "
              f"compiled, {graphs['loaded']} there already ({seconds:.1f} s)")
    return 0
