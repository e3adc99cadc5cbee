"""The transport benchmark's server child: a real vox-ws server on the tone engine."""

from __future__ import annotations

import asyncio
import logging

from ..config import Limits, ServerConfig
from ..engine import Engine
from ..server import VoxServer


def run_server(engine: Engine, port: int) -> None:
    logging.basicConfig(level=logging.WARNING)

    async def serve() -> None:
        config = ServerConfig(port=port, max_batch=engine.max_step_batch,
                              limits=Limits(max_connections=4096, max_connections_per_address=4096, max_queue=4096))
        server = VoxServer(config, engine)
        await server.start()
        server.install_signal_handlers()
        await asyncio.to_thread(server.scheduler.ready_event.wait)
        print("PORT", server.port, flush=True)
        await server.wait_stopped()

    try:
        import uvloop
    except ImportError:
        asyncio.run(serve())
    else:
        uvloop.run(serve())
