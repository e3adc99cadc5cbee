"""Multipart bodies, parsed in a process of their own.

Starlette's parser (python-multipart) is pure Python, and a hostile body (megabytes of
near-boundaries) keeps it busy for seconds. On a thread it would still hold the interpreter
against the event loop and the engine thread; in a process it shares nothing but a core, and at
the lowest CPU priority (Linux's SCHED_IDLE, else nice 19) it takes only what the server's own
threads and processes leave: an upload waits, the streams do not. One body is parsed at a time (a registration waits
its turn anyway); the process starts at the first multipart upload and lives as long as the
server.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor

from starlette.datastructures import FormData, Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from ..priority import lowest_priority

__all__ = ["MultiPartException", "MultipartParser"]


class MultipartParser:
    def __init__(self) -> None:
        self._executor: ProcessPoolExecutor | None = None

    async def parse(self, content_type: str, body: bytes, limit: int) -> dict[str, str | bytes]:
        """The body's fields, files as their bytes (the first of each name); raises
        MultiPartException for a body that is not multipart as declared."""
        if self._executor is None:
            self._executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=lowest_priority)
        loop = asyncio.get_running_loop()
        fields, error = await loop.run_in_executor(self._executor, parse_fields, content_type, body, limit)
        if error is not None:
            raise MultiPartException(error)
        return fields

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def parse_fields(content_type: str, body: bytes, limit: int) -> tuple[dict[str, str | bytes], str | None]:
    """In the parsing process: (fields, None), or ({}, why the body is not multipart)."""
    async def parse() -> FormData:
        async def chunks() -> AsyncIterator[bytes]:
            yield body
        headers = Headers({"content-type": content_type})
        return await MultiPartParser(headers, chunks(), max_files=1, max_fields=8, max_part_size=limit).parse()

    try:
        form = asyncio.run(parse())
    except MultiPartException as exc:
        return {}, exc.message
    fields: dict[str, str | bytes] = {}
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            value.file.seek(0)
            fields.setdefault(name, value.file.read(limit + 1))
            value.file.close()
        else:
            fields.setdefault(name, value)
    return fields, None
