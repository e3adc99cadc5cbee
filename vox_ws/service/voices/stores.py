"""The voice store a server opens, by its `--voice-store` spec."""

from __future__ import annotations

from .directory_store import DirectoryStore
from .memory_store import MemoryStore
from .redis_store import RedisStore
from .store import StoreLimits, VoiceStore


def open_store(spec: str, limits: StoreLimits) -> VoiceStore:
    """`memory`, `dir:PATH` or a `redis://` URL (`rediss://` for TLS)."""
    if spec == "memory":
        return MemoryStore(limits)
    if spec.startswith("dir:"):
        return DirectoryStore(spec[4:], limits)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, limits)
    raise ValueError(f"unknown voice store {spec!r}: memory, dir:PATH or redis://HOST:PORT/DB")
