"""Whole responses (`stream: false`): held until the stream has ended, then sent at the pace
their client reads.

A whole file must wait for its stream's end (its length goes first), so the stream is read as
fast as it is made and what it makes has to be held somewhere: here, in memory up to
`MEMORY_BYTES`, then in an unnamed temporary file written and read on a worker thread (never
on the event loop). What an owner's whole responses hold together is bounded, and so is what
all of them hold (`SpoolBudget`): a request past its owner's bound is refused `too_large` (it
may ask for the audio streamed), one that would take its owner, or everyone, past the bound
with others is refused `busy` (retryable). Once sending, a response must be taken at a minimum
rate (`SendClock`): a client that trickles (2 KB every 4 s held the budget for as long as it
liked: the write stall time-out sees progress) is closed and its bytes given back. That rate is
`--whole-min-rate`, or the response's own byte rate where higher (`Spool.send_floor`: no slower
than it plays), so a response holds its bytes about as long as its audio lasts at the most:
eight owners reading just over 16 KiB/s held the whole 1 GiB budget for two hours each.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from typing import IO, AsyncIterator

from ..engine import ErrorKind, Refused

# Bytes of a whole response held in memory; beyond, it goes to a temporary file.
MEMORY_BYTES = 2 << 20
# Bytes gathered before one write to the file (one hop to a worker thread each).
WRITE_BYTES = 256 << 10
# Bytes of the file read and sent at a time: the transport's flow control paces the next.
SEND_BYTES = 64 << 10


class SpoolBudget:
    """Bytes held by whole responses in flight, per owner and in all. Event loop only."""

    def __init__(self, per_owner: int, total: int) -> None:
        self.per_owner = per_owner
        self.total = total
        self._held: Counter[str] = Counter()
        self.spilled = 0                          # responses that went to a file

    @property
    def held(self) -> int:
        return sum(self._held.values())

    def take(self, owner: str, size: int, own: int) -> None:
        """`size` more bytes for a response of `owner` holding `own` already; Refused beyond
        the bounds."""
        if own + size > self.per_owner:
            raise Refused(ErrorKind.TOO_LARGE, f"the whole file would be over {self.per_owner >> 20} MB: ask for it "
                                               "streamed (`stream`: true)")
        if self._held[owner] + size > self.per_owner or self.held + size > self.total:
            raise Refused(ErrorKind.BUSY, "whole files in flight (yours, or everyone's) hold as much as they may: "
                                          "try again once they are sent, or ask for the audio streamed", 1.0)
        self._held[owner] += size

    def give_back(self, owner: str, size: int) -> None:
        self._held[owner] -= size
        if self._held[owner] <= 0:
            del self._held[owner]


class SendClock:
    """When a whole response's client must have taken more of it: `grace_s` from the start, one
    second more for every `min_rate` bytes taken (Apache mod_reqtimeout's rule for bodies, as
    `BodyClock`), but never more than `grace_s` beyond the last bytes taken, so a client that
    read fast at first cannot bank the time to hold the rest. A client slower than `min_rate`
    on average falls behind it for good. Times on the event loop's clock (`loop.time()`)."""

    def __init__(self, min_rate: float, grace_s: float, now: float) -> None:
        self._min_rate = min_rate
        self._grace_s = grace_s
        self.deadline = now + grace_s if min_rate > 0 else float("inf")

    def taken(self, size: int, now: float) -> None:
        if self._min_rate > 0:
            self.deadline = min(self.deadline + size / self._min_rate, now + self._grace_s)

    def left_s(self, now: float) -> float | None:
        """Seconds the client has for its next bytes (None: no floor)."""
        return None if self.deadline == float("inf") else max(0.0, self.deadline - now)


class Spool:
    """One whole response's bytes: `await write(...)` as they come, `rewrite(...)` what a header
    learns only at the end (the file's length), `size`, then `pieces()`;
    `await close()` always (it gives the bytes back to the budget and drops the file)."""

    def __init__(self, budget: SpoolBudget, owner: str, floor: tuple[float, float] = (0.0, 0.0)) -> None:
        self._budget = budget
        self._owner = owner
        self.floor = floor                 # (bytes a second, grace seconds) it must be taken at (`SendClock`)
        self.size = 0
        self._memory = bytearray()
        self._file: IO[bytes] | None = None
        self._rewrites: list[tuple[int, bytes]] = []

    def send_floor(self, audio_s: float | None) -> tuple[float, float]:
        """(bytes a second, grace seconds) the response must be taken at once written whole
        (`SendClock`), its `floor` holding `audio_s` seconds of audio: the floor's rate, or the
        response's own byte rate (its size over its audio's seconds) where higher. No floor (a
        rate of 0) stays none."""
        rate, grace = self.floor
        if rate > 0 and audio_s:
            rate = max(rate, self.size / audio_s)
        return rate, grace

    async def write(self, data: bytes) -> None:
        self._budget.take(self._owner, len(data), self.size)
        self.size += len(data)
        self._memory += data
        if self._file is None and len(self._memory) > MEMORY_BYTES:
            self._file = await asyncio.to_thread(tempfile.TemporaryFile, prefix="vox-ws-whole-")
            self._budget.spilled += 1
        if self._file is not None and len(self._memory) >= WRITE_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        assert self._file is not None
        pending, self._memory = bytes(self._memory), bytearray()
        await asyncio.to_thread(self._file.write, pending)

    def rewrite(self, offset: int, data: bytes) -> None:
        """`data` to stand at `offset` of what was written, once all is (a header that holds the
        file's length: `codecs.Encoded.rewrites`); applied to the pieces as they are sent."""
        if not 0 <= offset <= offset + len(data) <= self.size:
            raise ValueError(f"a rewrite of {len(data)} bytes at {offset} is outside the {self.size} written")
        self._rewrites.append((offset, data))

    async def pieces(self) -> AsyncIterator[bytes]:
        """The bytes written, rewrites applied, in order, a piece at a time."""
        start = 0
        async for piece in self._written():
            yield _rewritten(piece, start, self._rewrites)
            start += len(piece)

    async def _written(self) -> AsyncIterator[bytes]:
        if self._file is None:
            for start in range(0, len(self._memory), SEND_BYTES):
                yield bytes(self._memory[start:start + SEND_BYTES])
            return
        if self._memory:
            await self._flush()
        file = self._file
        await asyncio.to_thread(file.seek, 0)
        while piece := await asyncio.to_thread(file.read, SEND_BYTES):
            yield piece

    async def close(self) -> None:
        self._budget.give_back(self._owner, self.size)
        self.size = 0
        self._memory = bytearray()
        self._rewrites = []
        if self._file is not None:
            file, self._file = self._file, None
            await asyncio.to_thread(file.close)


def _rewritten(piece: bytes, start: int, rewrites: list[tuple[int, bytes]]) -> bytes:
    """`piece` (the bytes at `start` of a file) with the parts of `rewrites` that fall in it."""
    end = start + len(piece)
    touching = [(offset, data) for offset, data in rewrites if offset < end and offset + len(data) > start]
    if not touching:
        return piece
    patched = bytearray(piece)
    for offset, data in touching:
        lo, hi = max(offset, start), min(offset + len(data), end)
        patched[lo - start:hi - start] = data[lo - offset:hi - offset]
    return bytes(patched)
