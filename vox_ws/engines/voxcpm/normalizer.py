"""VoxCPM's text normalisation (numbers, money, dates to words: `voxcpm.utils.text_normalize`)
in a process of its own.

Normalising is pure Python that can run for seconds on a hostile text (a 4,999-digit run,
full-width digits after CJK), and its first use loads its grammars for about 3 s. On the
engine loop's thread that froze every stream; here it runs beside the engine, before a request is
queued (`Engine.text.prepare`), one text at a time, and a text that takes longer than its
time-out (`--normalize-timeout`, `NORMALIZE_TIMEOUT_S` by default) is refused (`too_large`) and
the process replaced.

    engine (a preparation thread)          worker (python -m vox_ws.engines.voxcpm.normalizer FD)
    start()          ── init ─────────▶    load TextNormalizer, normalise once
                     ◀── ready ───────
    normalize(text)  ── normalize ────▶    TextNormalizer.normalize
                     ◀── text ────────
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ...engine import ErrorKind, Refused
from ..child import Worker, WorkerCrashed, WorkerHung, serve_worker
from .settings import NORMALIZE_TIMEOUT_S

WORKER_MODULE = "vox_ws.engines.voxcpm.normalizer"
LOAD_TIMEOUT_S = 120.0


class Normalizer(Worker):
    """Thread-safe: preparation threads share it, one text at a time."""

    def __init__(self, timeout_s: float = NORMALIZE_TIMEOUT_S) -> None:
        super().__init__(WORKER_MODULE, "text normalizer")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()

    def start(self) -> None:  # type: ignore[override]
        super().start(("init",), LOAD_TIMEOUT_S)

    def restart(self) -> None:
        self.start()

    def ensure_started(self) -> None:
        with self._lock:
            if self.pid is None:
                self.start()

    def normalize(self, text: str) -> str:
        """Raises Refused: TOO_LARGE past the time-out, INVALID where the normaliser fails on
        the text, INTERNAL where its process died."""
        with self._lock:
            try:
                if self.pid is None:
                    self.start()
                return self.ask(("normalize", text), self.timeout_s, "normalizing")
            except WorkerHung:
                raise Refused(ErrorKind.TOO_LARGE, f"the text took over {self.timeout_s:g}s to normalize: send "
                                                   "shorter texts, or without normalize") from None
            except WorkerCrashed as exc:
                raise Refused(ErrorKind.INTERNAL, str(exc)) from None
            except RuntimeError as exc:
                raise Refused(ErrorKind.INVALID, f"the text could not be normalized: {exc}") from None


def _start(init: tuple) -> tuple[None, Callable[[str, Any], tuple]]:
    normalizer = _text_normalize_module().TextNormalizer()
    normalizer.normalize("Warm up: 123 and 4.5%.")
    return None, lambda kind, text: ("text", normalizer.normalize(text))


def _text_normalize_module():
    """voxcpm.utils.text_normalize, loaded by its path: it needs only regex, inflect and wetext,
    and importing the voxcpm package would bring torch into this process for nothing."""
    import importlib.util
    from pathlib import Path

    package = importlib.util.find_spec("voxcpm")
    if package is None or not package.submodule_search_locations:
        raise ImportError("the voxcpm package is not installed")
    path = Path(list(package.submodule_search_locations)[0]) / "utils" / "text_normalize.py"
    spec = importlib.util.spec_from_file_location("voxcpm_text_normalize", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    serve_worker(_start)
