"""Files the server is pointed at (a lexicon, an adapter's config), read within a bound.

`read_regular_file` opens without blocking, so a FIFO in a file's place is refused rather than
waited on (a read that never ends would hold a worker thread and the server's shutdown), and
refuses a file over its limit by its size, before a byte is read.
"""

from __future__ import annotations

import errno
import os
import stat


class NotRegularFile(OSError):
    pass


class FileTooLarge(OSError):
    pass


def read_regular_file(path: str | os.PathLike, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` + 1 of them (a file that grew past `limit` after
    its size was checked comes back longer than `limit`: the caller refuses it by that)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file")
        if info.st_size > limit:
            raise FileTooLarge(errno.EFBIG, f"over {limit} bytes")
        return f.read(limit + 1)
