"""One file of a Hugging Face repository downloaded within bounds, whatever the hub does.

huggingface_hub's `hf_hub_download` reads whatever a GET sends before it compares the size
with the HEAD's (a config said to be 4,794 bytes took 209 MB), and a hub that sends a byte a
second never trips its time-out between two reads. Here the same client (huggingface_hub's
session: `HF_ENDPOINT`, `HF_TOKEN`, proxies) asks, and the answer is read by this module:

    HEAD        the size the hub says; over `most` (the caller's bound) refused unfetched
    GET         read at most what the HEAD said (else `most`); a declared length over it refused
                unread, a byte past it stops the read; fewer than said is the hub's error too
    deadline    the whole download's (`Transfer`): checked at every piece, and each wait for
                one never longer than what is left
    stop        another thread may stop it (`Transfer.stop`: a server that shuts down abandons
                a fetch); the reader sees it at its next piece

A file goes into a folder the caller owns (a temporary one), never into the hub's cache.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# How long a download may take in all: a minute, then a floor on the rate (a slow link's
# 64 KiB/s) for its bytes. A Piper voice of 63 MB may so take 17 minutes; a hub that stalls, or
# drips a byte a second, is given up then, whatever its time-out between two reads.
DOWNLOAD_BASE_S = 60.0
DOWNLOAD_MIN_RATE = 64 << 10
PIECE_BYTES = 64 << 10

Progress = Callable[[str, int, "int | None"], None]      # (path, bytes so far, bytes said)


def deadline_for(size: int) -> float:
    """How long a download of `size` bytes may take in all, in seconds."""
    return DOWNLOAD_BASE_S + size / DOWNLOAD_MIN_RATE


class HubMisbehaved(RuntimeError):
    """The hub sent other than it said or than it may: more bytes than the bound or its own
    HEAD, fewer than its HEAD, or an error to a file its HEAD had."""


class HubTooSlow(HubMisbehaved):
    """The download was not done by its deadline."""


class DownloadStopped(Exception):
    """Another thread stopped the download (`Transfer.stop`)."""


class TooLarge(ValueError):
    """The hub's HEAD says the file is bigger than it may be: refused before a byte is read."""

    def __init__(self, path: str, size: int) -> None:
        super().__init__(f"the hub's {path} is {size} bytes")
        self.path = path
        self.size = size


class Transfer:
    """What bounds a download besides its bytes, for every file of it: its deadline
    (`deadline_s` from now, by `clock`), and `stop`, which any thread may set. `progress` is
    told of each piece (the command line's bars)."""

    def __init__(self, deadline_s: float, clock: Callable[[], float] = time.monotonic,
                 progress: Progress | None = None) -> None:
        self.deadline_s = deadline_s
        self.stop = threading.Event()
        self.progress = progress
        self._clock = clock
        self._ends = clock() + deadline_s

    def wait_s(self, most: float) -> float:
        """How long one wait for the hub may take: `most`, never past the deadline."""
        return max(0.001, min(most, self._ends - self._clock()))

    def check(self, path: str) -> None:
        """DownloadStopped once stopped, HubTooSlow once past the deadline."""
        if self.stop.is_set():
            raise DownloadStopped(f"the download of {path} was stopped")
        if self._clock() >= self._ends:
            raise HubTooSlow(f"the hub did not send {path} in time: a download must be done within "
                             f"{self.deadline_s:.0f} s")


def download(url: str, path: str, into: Path, most: int, transfer: Transfer) -> Path:
    """The file of a repository at `url` (huggingface_hub's `hf_hub_url`; `path`, its path there)
    into the folder `into` (a file of its name, which must not exist), at most `most` bytes;
    returns it. TooLarge where the hub's HEAD says it is
    bigger, HubMisbehaved where its GET does not send what the HEAD said (HubTooSlow: not in
    time), DownloadStopped once stopped; the hub's own errors (not found) as huggingface_hub
    raises them. A file left by a failure is the caller's to remove, with its folder."""
    from huggingface_hub import constants, get_hf_file_metadata, get_session

    transfer.check(path)
    session = get_session()
    try:
        said = get_hf_file_metadata(url, timeout=transfer.wait_s(constants.HF_HUB_ETAG_TIMEOUT)).size
        if said is not None and said > most:
            raise TooLarge(path, said)
        bound = _Bound(path, most, "the most it may be", None) if said is None else \
            _Bound(path, said, "what the hub said it is", said)
        return _read(session, url, bound, into / Path(path).name, transfer)
    except _timeouts(session) as exc:
        raise HubTooSlow(f"the hub sent nothing of {path} for a while ({type(exc).__name__}): "
                         "given up") from None


@dataclass(frozen=True)
class _Bound:
    path: str
    most: int                    # bytes
    what: str                    # what `most` is
    said: int | None             # the HEAD's size: exactly what must come


def _read(session: Any, url: str, bound: _Bound, target: Path, transfer: Transfer) -> Path:
    """The GET, read into `target` within `bound`."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    path = bound.path
    headers = {**build_hf_headers(), "Accept-Encoding": "identity"}       # bytes as stored: none inflated
    transfer.check(path)
    with session.stream("GET", url, headers=headers, follow_redirects=True,
                        timeout=transfer.wait_s(constants.HF_HUB_DOWNLOAD_TIMEOUT)) as response:
        if response.status_code >= 400:            # its body unread: an error's is as long as the hub likes
            raise HubMisbehaved(f"the hub answered {response.status_code} to the GET of {path}, whose HEAD "
                                "it had answered")
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > bound.most:
            raise HubMisbehaved(f"the hub's answer for {path} is {int(declared)} bytes, over {bound.most} "
                                f"({bound.what}): refused unread")
        received = 0
        with open(target, "xb") as out:
            for piece in response.iter_raw(PIECE_BYTES):
                received += len(piece)
                if received > bound.most:
                    raise HubMisbehaved(f"the hub sent more than {bound.most} bytes of {path} ({bound.what}): "
                                        "read no further")
                out.write(piece)
                transfer.check(path)
                if transfer.progress is not None:
                    transfer.progress(path, received, bound.said)
    if bound.said is not None and received != bound.said:
        raise HubMisbehaved(f"the hub sent {received} bytes of {path}, having said {bound.said}")
    return target


def _timeouts(session: Any) -> type[Exception]:
    """The HTTP client's time-out error (huggingface_hub's session is one of httpx's kind)."""
    client = importlib.import_module(type(session).__module__.split(".")[0])
    return client.TimeoutException
