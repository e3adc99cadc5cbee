"""Runs a server for the transport benchmark (old API)."""
import logging

from ..config import ServerConfig
from ..protocol import Limits
from ..server import VoxServer


def run_server(engine, port):
    logging.basicConfig(level=logging.WARNING)

    async def go():
        config = ServerConfig(port=port, max_batch=512, limits=Limits(max_connections=4096,
                              max_connections_per_address=4096, max_queue=4096))
        server = VoxServer(config, engine)
        await server.start()
        server.install_signal_handlers()
        server.scheduler.ready_event.wait()
        print("PORT", server.port, flush=True)
        await server.wait_stopped()

    import uvloop
    uvloop.run(go())
