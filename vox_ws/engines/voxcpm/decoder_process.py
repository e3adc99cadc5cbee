"""The streaming VAE decode in a process of its own, overlapped with generation.

On a CPU the VAE decode is most of a batched step, and the next patch never depends on the
audio, so the decode of step k can run while step k+1 is generated. A thread cannot do that
well: both halves are hundreds of small torch calls, and two threads hand one GIL back and
forth at every call (tiny model, B=8: generating a step took 10 ms alone and 21 ms beside a
decoding thread). A process has its own interpreter and its own core.

The parent sends each decode job (latents, the rows' KV slots, and the carried convolution
state of rows that are new to the process) over a socket and reads the audio back in order;
the process keeps every slot's carried state, as the parent's decoder does
(`vae.BatchedStreamingVAE`), until a row entering that slot brings its own. Messages are pickled numpy arrays, never
tensors: torch would pickle tensors as shared-memory handles.

    parent                                   decoder process
    DecoderProcess()        ── start ───▶    import torch, voxcpm (the parent loads meanwhile)
    load_vae(vae)           ── init ────▶    build and warm the VAE up
    wait_ready()            ◀── ready ───
    compile(buckets)        ── compile ─▶    compile the decode per bucket
    wait_compiled()         ◀── compiled ─
    submit(latents k, slots) ── decode ─▶    decode, keep state
    (generates step k+1)                     ...
    job k.result()          ◀── audio ───    reply

If the process dies the engine cannot go on: every job's result raises `EngineFailure`.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ...engine import EngineFailure
from ..child import grace_until, receive, send, start_child, stop_child

# How long one decode may take before the process is presumed hung (a real-size decode of 16
# rows on a slow CPU takes seconds, not minutes).
REPLY_TIMEOUT_S = 120.0
# How long compiling the decode (`--compile`) may take: a few buckets, tens of seconds each on a
# small CPU, while the parent compiles beside it.
COMPILE_TIMEOUT_S = 1800.0
# The module the decoder process runs.
DECODER_MAIN = "vox_ws.engines.voxcpm.decoder_main"


class DecoderProcess:
    """The parent's handle on the decoder process. `submit` and `close` come from one thread
    (the engine's); a reader thread takes the replies as they come, so neither side can block
    the other on a full socket buffer."""

    def __init__(self, *, threads: int, warm_compiler: bool = False) -> None:
        """Start the process. It imports torch and voxcpm (and warms its compiler up, where a
        `compile` will follow: `warm_compiler`) while the parent loads the model; `load_vae`
        then gives it the VAE."""
        self._proc, self._conn = start_child(DECODER_MAIN, threads)
        self._threads = threads
        self._outstanding: deque[Future] = deque()
        self._lock = threading.Lock()
        self._failed: EngineFailure | None = None
        self._closed = False
        self._ready: Future = Future()
        self._compiled: Future | None = None
        self.has_vae = False
        self._send(("start", warm_compiler))
        self._reader = threading.Thread(target=self._read_replies, name="vox-ws-vae-replies", daemon=True)
        self._reader.start()

    def load_vae(self, vae_class: type, vae_config: Any, state_dict: dict[str, Any], *, slots: int,
                 rows_per_call: int | None, warm_up: tuple[int, int]) -> None:
        """Give the process a copy of the VAE (class, config, weights) and the number of KV slots
        whose streams it may decode; it warms up for `warm_up` = (patch size, max rows) while the
        parent goes on loading (`wait_ready`)."""
        weights = {name: tensor.detach().cpu().numpy() for name, tensor in state_dict.items()}
        self._send(("init", vae_class, vae_config, weights, self._threads, slots, rows_per_call, warm_up))
        self.has_vae = True

    @property
    def pid(self) -> int:
        return self._proc.pid

    def submit(self, latents: Any, slots: list[int], entering: tuple[list[int], list[Any]] | None = None) -> Future:
        """Decode latents [B, D, P] of the streams in `slots`; `entering` = (slots, their carried
        state per convolution, `export_states`) seeds the streams new to the process with the
        state their earlier audio left (decoded in the parent). The future's result is the
        audio, [B, samples] float32 numpy; its `decode_s`, the decode's time."""
        job: Future = Future()
        with self._lock:
            if self._failed is not None:
                raise self._failed
            self._outstanding.append(job)
        self._send(("decode", latents.numpy(), slots, entering))
        return job

    def compile(self, buckets: tuple[int, ...], cache_dir: str, patch_size: int) -> None:
        """Have the process compile its decode for these row counts (`vae.BatchedStreamingVAE.compile`),
        keeping the compiled code in `cache_dir`; `wait_compiled` waits for it."""
        self._compiled = Future()
        self._send(("compile", buckets, cache_dir, patch_size))

    def wait_compiled(self, timeout: float = COMPILE_TIMEOUT_S) -> tuple[int, int]:
        """Block until the process has compiled (`compile`): the graphs it loaded and compiled."""
        return self.wait(self._compiled, timeout)

    def wait_ready(self, timeout: float = REPLY_TIMEOUT_S) -> None:
        """Block until the process has built and warmed its VAE (and its compiler, if asked to)."""
        self.wait(self._ready, timeout)

    def wait(self, job: Future, timeout: float = REPLY_TIMEOUT_S) -> Any:
        """A job's audio, once it is back."""
        try:
            return job.result(timeout)
        except FutureTimeout:
            raise self._fail(f"no reply in {timeout:.0f} s") from None

    def close(self, deadline: float | None = None) -> None:
        """Stop the process: within STOP_GRACE_S, or by `deadline` (`time.monotonic()`: the end
        of the server's shutdown) where that is sooner."""
        if self._closed:
            return
        self._closed = True
        stop_child(self._proc, self._conn, grace_until(deadline))
        self._reader.join(grace_until(deadline))

    def _send(self, message: tuple) -> None:
        try:
            send(self._conn, message)
        except OSError as exc:
            raise self._fail(f"cannot reach it: {exc}") from exc

    def _read_replies(self) -> None:
        while True:
            try:
                kind, payload = receive(self._conn)
            except (EOFError, OSError):
                self._fail("it exited" if not self._closed else "closed")
                return
            if kind == "ready":
                self._ready.set_result(None)
                continue
            if kind in ("compiled", "compile failed"):
                if kind == "compiled":
                    self._compiled.set_result(payload)
                else:
                    self._compiled.set_exception(RuntimeError(f"compiling the VAE decode failed: {payload}"))
                continue
            with self._lock:
                job = self._outstanding.popleft()
            if kind == "audio":
                audio, job.decode_s = payload     # the decode's own time, without the transfers
                job.set_result(audio)
            else:
                job.set_exception(RuntimeError(f"VAE decode failed in the decoder process: {payload}"))

    def _fail(self, what: str) -> EngineFailure:
        code = self._proc.poll()
        failure = EngineFailure(f"VAE decoder process (pid {self._proc.pid}): {what}"
                                + (f" (exit code {code})" if code is not None else ""))
        with self._lock:
            self._failed = self._failed or failure
            waiting = [self._ready, self._compiled]
            orphans = list(self._outstanding) + [f for f in waiting if f is not None and not f.done()]
            self._outstanding.clear()
        for job in orphans:
            job.set_exception(self._failed)
        return self._failed
