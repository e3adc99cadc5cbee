"""Memory the process has freed, given back to the system.

glibc keeps the heap's freed pages for reuse: after a reference audio's decode and encode (tens
of megabytes of buffers for a 30 s file), the process would keep that peak for good.
`release_memory` asks glibc to return what is free (`malloc_trim`); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):     # not glibc (musl, macOS): nothing to trim with
        return None


def release_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
