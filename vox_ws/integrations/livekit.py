"""`vox_ws.clients.livekit` under its first name."""

from ..clients.livekit import *  # noqa: F401,F403
