"""`vox_ws.clients.pipecat` under its first name."""

from ..clients.pipecat import *  # noqa: F401,F403
