"""`vox_ws.client`, where the Python client of protocol v1 was first published: the names of
`vox_ws.clients.v1`, kept here for the code (and the README's readers) that import them so."""

from .clients.v1 import *  # noqa: F401,F403
