"""LoRA adapters: load, unload, enable and disable, by name from the configured directory only."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ...engine import ErrorKind, Refused


class LoraControl:
    """Runs on the scheduler thread, between two steps: streams in flight continue with the new
    weights from their next chunk."""

    def __init__(self, rank: int, directory: str | None) -> None:
        self.directory = Path(directory) if directory else None
        self.state: dict[str, Any] = {"configured": rank > 0, "loaded": None, "enabled": False}

    def apply(self, model: Any, op: str, name: str | None) -> dict[str, Any]:
        if not self.state["configured"]:
            raise Refused(ErrorKind.UNSUPPORTED, "LoRA is not configured: start the server with --lora-rank N")
        result: dict[str, Any] = {"op": op}
        if op == "load":
            path = self._path(name)
            loaded, skipped = model.load_lora_weights(str(path))
            if not loaded:
                raise Refused(ErrorKind.INVALID, f"LoRA {name!r} matched no parameter of this model "
                                                 f"({len(skipped)} skipped)")
            model.set_lora_enabled(True)
            self.state.update(loaded=name, enabled=True)
            result.update(name=name, loaded=len(loaded), skipped=len(skipped))
        elif op == "unload":
            model.reset_lora_weights()
            self.state.update(loaded=None, enabled=False)
        elif op in ("enable", "disable"):
            if self.state["loaded"] is None:
                raise Refused(ErrorKind.INVALID, "no LoRA is loaded")
            model.set_lora_enabled(op == "enable")
            self.state["enabled"] = op == "enable"
        else:
            raise Refused(ErrorKind.INVALID, f"field 'op' must be load, unload, enable or disable, got {op!r}")
        result["lora"] = dict(self.state)
        return result

    def _path(self, name: str | None) -> Path:
        if self.directory is None:
            raise Refused(ErrorKind.UNSUPPORTED, "no --lora-dir configured: adapters load only from that directory")
        if not name or not re.fullmatch(r"[\w.-]+", name) or name.startswith("."):
            raise Refused(ErrorKind.INVALID, "field 'name' must be an adapter name (letters, digits, '.', '_', '-')")
        for candidate in (self.directory / name, self.directory / f"{name}.safetensors",
                          self.directory / f"{name}.ckpt", self.directory / f"{name}.pth"):
            if candidate.exists():
                return candidate
        raise Refused(ErrorKind.INVALID, f"no LoRA adapter named {name!r} in the LoRA directory")
