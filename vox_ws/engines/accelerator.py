"""What the engine loop knows of an accelerator, whatever the engine: which errors mean its device
is lost, and which device a thread works on.

torch is looked up (`sys.modules`), never imported here: where it was never imported (a Piper
server) no torch error can have been raised, and no thread has a CUDA device to enter.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

# Held around work on a device that must not overlap a CUDA graph's capture: the capture itself
# (one at a time in a process), a thread's encoding of voices, a background compile's reader
# loading graphs, a model's load. Reentrant: a capture may load what it captures.
DEVICE_LOCK = threading.RLock()

# CUDA's sticky errors, as `cudaGetErrorString` words them (torch says "CUDA error: <that>",
# Triton "Triton Error [CUDA]: <that>"): after one, the process's CUDA context is corrupt and every
# later call fails the same way, so no later step can succeed. cuBLAS reports a kernel it could
# not run (under it, one of these) as its own status.
STICKY_ERRORS = (
    "an illegal memory access was encountered",                # cudaErrorIllegalAddress
    "device-side assert triggered",                            # cudaErrorAssert
    "unspecified launch failure",                              # cudaErrorLaunchFailure
    "misaligned address",                                      # cudaErrorMisalignedAddress
    "an illegal instruction was encountered",                  # cudaErrorIllegalInstruction
    "hardware stack error",                                    # cudaErrorHardwareStackError
    "invalid program counter",                                 # cudaErrorInvalidPc
    "operation not supported on global/shared address space",  # cudaErrorInvalidAddressSpace
    "the launch timed out and was terminated",                 # cudaErrorLaunchTimeout
    "uncorrectable ecc error encountered",                     # cudaErrorECCUncorrectable
    "uncorrectable nvlink error",                              # cudaErrorNvlinkUncorrectable
    "cuda-capable device(s) is/are busy or unavailable",       # cudaErrorDevicesUnavailable
    "cublas_status_execution_failed",
)
# Memory a step could not have: that step's requests fail, and the next step may fit.
OUT_OF_MEMORY = ("out of memory", "cublas_status_alloc_failed")
# How far down an error's causes (`raise ... from`) and contexts the search goes.
MAX_CHAIN = 8


def device_lost(error: BaseException) -> str | None:
    """Why `error` means the device is lost (its type and the first line of its message), or
    None where it does not: torch's `AcceleratorError` (an accelerator API call failed) or an
    error carrying one of CUDA's sticky errors, itself or down its causes; never running out of
    memory (`torch.OutOfMemoryError`, or CUDA's "out of memory"), which spares the device."""
    torch = sys.modules.get("torch")
    accelerator_error = getattr(torch, "AcceleratorError", None) if torch is not None else None
    out_of_memory = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen and len(seen) < MAX_CHAIN:
        seen.add(id(link))
        text = str(link).lower()
        memory = (out_of_memory is not None and isinstance(link, out_of_memory)) or \
            any(words in text for words in OUT_OF_MEMORY)
        if not memory and ((accelerator_error is not None and isinstance(link, accelerator_error))
                           or any(words in text for words in STICKY_ERRORS)):
            first_line = str(link).strip().splitlines()[0] if str(link).strip() else ""
            return f"{type(link).__name__}: {first_line}"
        link = link.__cause__ or link.__context__
    return None


def enter_device(device: str) -> None:
    """Make `device` ("cuda:1") the calling thread's current CUDA device, for good. torch's
    current stream, a CUDA graph's capture and an allocation with no device named follow the
    thread's current device, which is device 0 until set: an engine on cuda:1 would capture on
    device 0's stream. Nothing for any other device (a CPU, "cuda" alone, "auto")."""
    index = _cuda_index(device)
    if index is not None:
        import torch

        torch.cuda.set_device(index)


@contextlib.contextmanager
def exclusive_on(device: str) -> Iterator[None]:
    """`on_device`, holding `DEVICE_LOCK`: work of another thread than the engine's that must
    not overlap a capture."""
    with DEVICE_LOCK, on_device(device):
        yield


@contextlib.contextmanager
def on_device(device: str) -> Iterator[None]:
    """`device` as the current CUDA device for the block, then the one before it: for a thread
    that serves every device in turn (the voice thread)."""
    index = _cuda_index(device)
    if index is None:
        yield
        return
    import torch

    with torch.cuda.device(index):
        yield


def _cuda_index(device: str) -> int | None:
    kind, _, index = device.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None
