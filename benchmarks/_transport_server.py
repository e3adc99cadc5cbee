"""The benchmarks' server child: a real vox-ws server on the engine a benchmark gives it."""

from __future__ import annotations

import asyncio
import logging

from vox_ws.config import Limits, ServerConfig
from vox_ws.engine import Engine
from vox_ws.server import VoxServer

# VoxCPM2's pace: one 160 ms chunk at 48 kHz per step, a step every 50 ms.
VOXCPM_CHUNK_S = 0.16
VOXCPM_STEP_S = 0.05


def bench_engine(name: str) -> Engine:
    """The engine a benchmark names: `piper` (the real CPU voice), or `tone`, paced like VoxCPM2."""
    if name == "piper":
        from vox_ws.engines.piper import PiperEngine

        return PiperEngine()
    from vox_ws.testing.tone import ToneEngine

    return ToneEngine(sample_rate=48_000, chunk_s=VOXCPM_CHUNK_S, step_interval_s=VOXCPM_STEP_S)


def run_server(engine: Engine, port: int, config: ServerConfig | None = None, port_file: str | None = None) -> None:
    """Serve until SIGTERM. Once the engine is ready, the port is printed ("PORT n") and, with
    `port_file`, written there."""
    logging.basicConfig(level=logging.WARNING)
    config = config or ServerConfig(port=port, slots=engine.max_step_batch,
                                    limits=Limits(max_connections=4096, max_connections_per_address=4096,
                                                  max_queue=4096))

    async def serve() -> None:
        server = VoxServer(config, engine)
        await server.start()
        server.install_signal_handlers()
        await asyncio.to_thread(server.devices.ready_event.wait)
        print("PORT", server.port, flush=True)
        if port_file:
            with open(port_file, "w") as f:
                f.write(str(server.port))
        await server.wait_stopped()

    try:
        import uvloop
    except ImportError:
        asyncio.run(serve())
    else:
        uvloop.run(serve())
