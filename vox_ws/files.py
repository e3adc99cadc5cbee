"""Files the server is pointed at (a lexicon, an adapter's config), read within a bound; files
it keeps for itself (the voice store), private and whole.

`read_regular_file` opens without blocking, so a FIFO in a file's place is refused rather than
waited on (a read that never ends would hold a worker thread and the server's shutdown), and
refuses a file over its limit by its size, before a byte is read.

`make_private_dir` and `write_private_file` make directories 0700 and files 0600 whatever the
umask (a umask only takes bits away from a mode asked for; with 0o000 mkdir's and open's
defaults leave everything readable by every local user), and a file written is whole or absent.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


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


class UnreadableJson(ValueError):
    """A JSON file that could not be read or is not a JSON object: why, in a few words."""


NOT_AN_OBJECT = "not a JSON object"


def read_json_object(path: str | os.PathLike, limit: int) -> dict[str, Any]:
    """A file of one JSON object, read once within `limit` bytes, a regular file only;
    UnreadableJson saying why otherwise (the caller names the file)."""
    try:
        data = read_regular_file(path, limit)
        if len(data) > limit:                                  # it grew after its size was read
            raise FileTooLarge(errno.EFBIG, f"over {limit} bytes")
        document = json.loads(data.decode("utf-8"))
    except RecursionError:
        # json refuses nesting past the interpreter's recursion limit (about 1,000) with this:
        # 200,000 nested arrays (130 KB) stopped every start. No Piper file nests past 3.
        raise UnreadableJson("nested too deeply") from None
    except OSError as exc:
        raise UnreadableJson(exc.strerror or str(exc)) from None
    except ValueError as exc:                                  # not UTF-8, not JSON
        raise UnreadableJson(str(exc)) from None
    if not isinstance(document, dict):
        raise UnreadableJson(NOT_AN_OBJECT)
    return document


def make_private_dir(path: Path) -> None:
    """Create `path` and its missing parents 0700 (mkdir, then chmod: the umask may have taken
    bits off); an existing directory is left as it is."""
    missing = []
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, PRIVATE_DIR_MODE)
        except FileExistsError:          # made meanwhile by another process: taken as found
            continue
        os.chmod(directory, PRIVATE_DIR_MODE)


def write_private_file(path: Path, data: bytes, replace: bool = True) -> bool:
    """Write `data` to `path` whole or not at all, readable by this user only from its creation:
    into a new file beside it (0600 whatever the umask, never through a link), synced, then
    moved into place: renamed over `path`, or with `replace` False linked to it, so that an
    existing `path` is left as it is (False is returned). A failed write (a full disk, a file
    size limit) leaves `path` as it was and no new file behind; the error is raised."""
    partial = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), PRIVATE_FILE_MODE)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        if replace:
            os.replace(partial, path)
        else:
            try:
                os.link(partial, path)
            except FileExistsError:
                return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)                   # gone already once renamed
    sync_directory(path.parent)
    return True


def is_partial(name: str) -> bool:
    """Whether a file's name is one `write_private_file` writes before moving it into place."""
    return name.startswith(".") and name.endswith(".partial")


def sync_directory(path: Path) -> None:
    """Make a rename or a link in `path` durable (where the file system can say so)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):     # a directory it cannot sync
            raise
    finally:
        os.close(fd)
