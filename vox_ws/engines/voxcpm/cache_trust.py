"""Whether a compile cache may be read: its files are code.

Saved graphs are read back by PyTorch's precompile loader and inductor's caches, which unpickle:
whoever can write a file there runs code as the server at its next start. So the cache is used
only when no one else can have written it: a real directory (no link) owned by this uid that
group and others may not write (it is created 0700), every entry under it owned by this uid (and,
where others may enter the directory, writable by no one else), and no parent on its path that
others may write without the sticky bit (from which they could swap the directory). A cache that is not private is left
untouched (not loaded, not repaired, not written): the step compiles into a private directory
of this process instead (one, whatever it asks for, removed when it exits), and a warning says
why and what to do.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from ...files import make_private_dir

log = logging.getLogger("vox_ws.engines.voxcpm")

# Where inductor keeps its kernels when not in the compile cache (`compiled.use_cache_dir`).
KERNEL_CACHE_ENV = "VOX_WS_KERNEL_CACHE"


def trusted_cache_dir(requested: Path) -> Path:
    """`requested`, created 0700 where missing, when it is private to this user; else a new
    private directory (compiled into from scratch: a next start will not find it)."""
    requested = Path(os.path.abspath(requested))
    try:
        make_private_dir(requested)     # an existing one is left as found: checked, never made private now
        problem = why_untrusted(requested)
    except OSError as exc:
        problem = f"it cannot be made or read ({exc.strerror or exc})"
    if problem is None:
        return requested
    fallback = _fallback_dir()
    log.warning("compile cache %s not used: %s. Its files are code the server runs; it must be a directory "
                "owned by uid %d with mode 0700 (chmod 700), holding only this user's files. Compiling into %s "
                "instead (removed at exit: a next start compiles again)", requested, problem, os.geteuid(),
                fallback)
    return fallback


_fallback: Path | None = None


def _fallback_dir() -> Path:
    """This process's one private directory for a cache it may not use: made once, reused by
    every later ask (its children are given its path, which they may trust), and removed when
    the process exits."""
    global _fallback
    if _fallback is None or not _fallback.is_dir():
        _fallback = Path(tempfile.mkdtemp(prefix="vox-ws-compile-"))
        atexit.register(shutil.rmtree, _fallback, ignore_errors=True)
    return _fallback


def why_untrusted(path: Path) -> str | None:
    """Why a directory of compiled code must not be loaded, or None when it is private."""
    uid = os.geteuid()
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != uid:
        return f"{path} is owned by uid {info.st_uid}, not this server's"
    if info.st_mode & 0o022:
        return f"{path} may be written by others (mode {stat.S_IMODE(info.st_mode):04o})"
    for parent in path.parents:
        mode = os.stat(parent).st_mode
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            return f"anyone may write {parent}, and so put another directory in its place"
    # Under a directory others cannot enter (0700), no entry's mode lets them in; under one they
    # can, no entry may be writable by them.
    reachable = bool(info.st_mode & 0o011)
    for root, dirs, files in os.walk(path):          # links are not followed
        for name in dirs + files:
            entry = os.path.join(root, name)
            found = os.lstat(entry)
            if found.st_uid != uid:
                return f"{entry} is owned by uid {found.st_uid}, not this server's"
            if reachable and found.st_mode & 0o022 and not stat.S_ISLNK(found.st_mode):
                return f"{entry} may be written by others (mode {stat.S_IMODE(found.st_mode):04o})"
    return None
