"""LoRA adapters by name: read from the configured directory, loaded into slots, pinned by streams.

An adapter file is the voxcpm package's own format (`lora_weights.safetensors` or `.ckpt` in a
directory, or such a file; keys `MODULE.lora_A` [r, in] and `MODULE.lora_B` [out, r]). Its keys
are matched as the package's `load_lora_weights` matches them, and reported the same way
(loaded, skipped); an optional `lora_config.json` beside the weights gives the adapter's own
`r` and `alpha` (scaling alpha / r), else the server's `--lora-alpha` / `--lora-rank` apply, as
in the package.

Threads: `read` runs on a worker thread (disk); `load`, `unload` and the default run on the
engine loop's thread between two steps; `pin` / `unpin` on the event loop; `row_started` /
`row_ended` on the engine loop's thread. A slot is reused only once no stream pins its adapter
and no request in the engine uses it, so weights are never rewritten under a row.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...engine import ErrorKind, Loras, Refused
from ...files import FileTooLarge, NotRegularFile, read_regular_file
from .lora import NO_ADAPTER, RowAdapters, RowLoRALinear

NAME_PATTERN = re.compile(r"[\w.-]{1,64}")
# How large (its norm) a hidden activation may be for `_check_range`: far beyond a working model's.
MAX_ACTIVATION_NORM = 1e6
# A lora_config.json holds two numbers: a larger one is no adapter's config.
MAX_CONFIG_BYTES = 64 * 1024
# A name is a file name in the LoRA directory (and the names of its files add a suffix to it).
MAX_NAME_BYTES = 128
# An adapter file larger than this is no LoRA adapter of a model this size.
MAX_ADAPTER_BYTES = 1 << 30


@dataclass(frozen=True)
class AdapterFile:
    """One adapter as read from disk: its weights by module name, on the CPU."""

    name: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]   # module -> (lora_A, lora_B)
    rank: int
    scaling: float
    loaded: tuple[str, ...]
    skipped: tuple[str, ...]


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: its slot, and who uses it. What `AdapterBook.pin` gives a stream,
    which holds it (the adapter stays) until `unpin`."""

    name: str
    slot: int
    rank: int
    scaling: float
    loaded: int
    skipped: int
    streams: int = 0           # streams pinning it
    rows: int = 0              # requests using it in the engine
    unloading: bool = False    # no new stream may pin it; the slot frees when the last one ends

    def summary(self, default: str | None) -> dict[str, Any]:
        return {"name": self.name, "slot": self.slot, "rank": self.rank, "scaling": self.scaling,
                "streams": self.streams, "state": "unloading" if self.unloading else "loaded",
                "default": self.name == default}


class AdapterBook(Loras):
    """The adapter slots of one device: which adapter each holds, and who uses it."""

    def __init__(self, adapters: RowAdapters | None, layers: dict[str, RowLoRALinear], directory: str | None,
                 alpha: float, package_keys: frozenset[str] = frozenset()) -> None:
        self.adapters = adapters
        self.layers = layers
        self.directory = Path(directory).resolve() if directory else None
        self.default_scaling = alpha / adapters.rank if adapters is not None else 0.0
        # Every other parameter name of the package's model: a file carrying one would change
        # the base model for every stream (the package copies it in); refused here.
        self._package_keys = package_keys
        self._by_name: dict[str, Adapter] = {}
        self._lock = threading.Lock()
        self.default: str | None = None

    # ------------------------------------------------------------------ reporting

    def slot_bytes(self) -> int:
        return sum(layer.slot_bytes() for layer in self.layers.values())

    def describe(self) -> dict[str, Any]:
        if self.adapters is None:
            return {"configured": False}
        with self._lock:
            listed = [a.summary(self.default) for a in sorted(self._by_name.values(), key=lambda a: a.slot)]
        return {"configured": True, "rank": self.adapters.rank, "slots": self.adapters.slots,
                "slot_bytes": self.slot_bytes(), "layers": len(self.layers), "adapters": listed,
                "default": self.default}

    # ------------------------------------------------------------------ streams (event loop)

    def pin(self, name: str | None) -> Adapter | None:
        """The adapter a new stream speaks with: `name`, or the default where it names none
        (None: the base model). Raises Refused."""
        with self._lock:
            if name is None:
                name = self.default
                if name is None:
                    return None
            elif self.adapters is None:
                raise Refused(ErrorKind.UNSUPPORTED, "LoRA is not configured: start the server with --lora-rank N",
                              field="lora")
            adapter = self._by_name.get(name)
            if adapter is None:
                raise self._unknown(name, "lora")
            if adapter.unloading:
                raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r} is being unloaded: {adapter.streams} "
                                                 "stream(s) still speak with it, no new one may", field="lora")
            adapter.streams += 1
            return adapter

    def unpin(self, adapter: Adapter | None) -> None:
        if adapter is None:
            return
        with self._lock:
            adapter.streams -= 1
            self._free_if_unused(adapter)

    # ------------------------------------------------------------------ requests (engine loop's thread)

    def row_started(self, adapter: Adapter | None) -> int:
        """A request of a stream pinning `adapter` took a row: its slot (`NO_ADAPTER` for none)."""
        if adapter is None:
            return NO_ADAPTER
        with self._lock:
            adapter.rows += 1
        return adapter.slot

    def row_ended(self, adapter: Adapter | None) -> None:
        if adapter is None:
            return
        with self._lock:
            adapter.rows -= 1
            self._free_if_unused(adapter)

    def _free_if_unused(self, adapter: Adapter) -> None:
        if adapter.unloading and adapter.streams <= 0 and adapter.rows <= 0 \
                and self._by_name.get(adapter.name) is adapter:
            del self._by_name[adapter.name]

    def _unknown(self, name: str, field: str) -> Refused:
        loaded = sorted(n for n, a in self._by_name.items() if not a.unloading)
        return Refused(ErrorKind.INVALID, f"unknown LoRA adapter {name!r} (loaded: {loaded})", field=field)

    # ------------------------------------------------------------------ files (any thread)

    def read(self, name: str | None) -> AdapterFile:
        """Read and check an adapter file from the LoRA directory. Raises Refused."""
        self._configured()
        path = self._path(name)
        weights_file = path / "lora_weights.safetensors" if path.is_dir() else path
        if path.is_dir() and not weights_file.exists():
            weights_file = path / "lora_weights.ckpt"
        if not weights_file.is_file() or not weights_file.resolve().is_relative_to(self.directory):
            raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r} has no lora_weights.safetensors or "
                                             "lora_weights.ckpt", field="name")
        size = weights_file.stat().st_size              # checked before a byte is read
        if size > MAX_ADAPTER_BYTES:
            raise Refused(ErrorKind.TOO_LARGE, f"LoRA adapter {name!r} is {size} bytes, over the "
                                               f"{MAX_ADAPTER_BYTES} an adapter file may have", field="name")
        try:
            if weights_file.suffix == ".safetensors":
                from safetensors.torch import load_file

                state = load_file(str(weights_file), device="cpu")
            else:
                checkpoint = torch.load(weights_file, map_location="cpu", weights_only=True)
                state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
        except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file: the admin's to fix
            said = str(exc)[:200].replace(str(self.directory), "<lora-dir>")
            raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r} cannot be read: {type(exc).__name__}: "
                                             f"{said}", field="name") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r} is not a map of tensors", field="name")
        return self._check(name, state, self._config(path))

    def _check(self, name: str, state: dict[str, torch.Tensor], config: dict[str, Any]) -> AdapterFile:
        halves: dict[str, dict[str, torch.Tensor]] = {}
        loaded, skipped, base = [], [], []
        for key, value in state.items():
            module, _, part = key.rpartition(".")
            if module in self.layers and part in ("lora_A", "lora_B"):
                halves.setdefault(module, {})[part] = value
                loaded.append(key)
            elif key in self._package_keys:
                base.append(key)
            else:
                skipped.append(key)
        if base:
            raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r} carries {len(base)} weights of the base model "
                                             f"(e.g. {base[0]!r}): only lora_A / lora_B load per stream", field="name")
        if not loaded:
            raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r} matched no LoRA layer of this model "
                                             f"({len(skipped)} keys skipped)", field="name")
        slot_rank = self.adapters.rank
        weights, ranks = {}, set()
        for module, parts in halves.items():
            layer = self.layers[module]
            a, b = parts.get("lora_A"), parts.get("lora_B")
            if a is None or b is None:
                raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r}: {module} has only one of lora_A, lora_B",
                              field="name")
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != layer.in_features or b.shape[0] != layer.out_features \
                    or a.shape[0] != b.shape[1]:
                raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r} does not fit this model: {module} is "
                                                 f"{layer.in_features} -> {layer.out_features}, the adapter has "
                                                 f"lora_A {list(a.shape)}, lora_B {list(b.shape)}", field="name")
            if a.shape[0] > slot_rank:
                raise Refused(ErrorKind.TOO_LARGE, f"LoRA adapter {name!r} has rank {a.shape[0]}, over the slots' "
                                                   f"{slot_rank} (--lora-rank)", field="name")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r}: {module} holds values that are not finite",
                              field="name")
            weights[module] = (a, b)
            ranks.add(a.shape[0])
        rank = max(ranks)
        if config:
            scaling = float(config["alpha"]) / float(config["r"])
        else:
            scaling = self.default_scaling
        for module, (a, b) in weights.items():
            _check_range(name, module, a, b, scaling, self.adapters.dtype)
        return AdapterFile(name, weights, rank, scaling, tuple(loaded), tuple(skipped))

    def _config(self, path: Path) -> dict[str, Any]:
        """The adapter's own r and alpha: `lora_config.json` in its directory (or NAME.json
        beside its file), either at the top or under "lora_config" or "lora". Only a regular
        file inside the LoRA directory counts (not a link out of it, nor a FIFO that would never
        end), of at most MAX_CONFIG_BYTES, read no further than that."""
        candidate = path / "lora_config.json" if path.is_dir() else path.with_suffix(".json")
        if not candidate.exists():
            return {}
        if not candidate.resolve().is_relative_to(self.directory):
            raise Refused(ErrorKind.INVALID, f"{candidate.name} points out of the LoRA directory", field="name")
        try:
            data = read_regular_file(candidate, MAX_CONFIG_BYTES)
        except FileTooLarge:
            raise Refused(ErrorKind.TOO_LARGE, f"{candidate.name} is over {MAX_CONFIG_BYTES} bytes",
                          field="name") from None
        except NotRegularFile:
            raise Refused(ErrorKind.INVALID, f"{candidate.name} is not a regular file", field="name") from None
        except OSError as exc:
            raise Refused(ErrorKind.INVALID, f"{candidate.name} cannot be read ({exc.strerror})",
                          field="name") from None
        if len(data) > MAX_CONFIG_BYTES:
            raise Refused(ErrorKind.TOO_LARGE, f"{candidate.name} is over {MAX_CONFIG_BYTES} bytes", field="name")
        try:
            config = json.loads(data)
        except ValueError as exc:
            raise Refused(ErrorKind.INVALID, f"{candidate.name} is not JSON: {exc}", field="name") from None
        if not isinstance(config, dict):
            raise Refused(ErrorKind.INVALID, f"{candidate.name} is not a JSON object", field="name")
        for inner in (config.get("lora_config"), config.get("lora"), config):
            if isinstance(inner, dict) and "r" in inner and "alpha" in inner:
                r, alpha = inner["r"], inner["alpha"]
                if not all(_positive(v) for v in (r, alpha)):
                    raise Refused(ErrorKind.INVALID, f"{candidate.name}: r and alpha must be positive numbers",
                                  field="name")
                return {"r": r, "alpha": alpha}
        return {}

    def _configured(self) -> None:
        if self.adapters is None:
            raise Refused(ErrorKind.UNSUPPORTED, "LoRA is not configured: start the server with --lora-rank N")
        if self.directory is None:
            raise Refused(ErrorKind.UNSUPPORTED, "no --lora-dir configured: adapters load only from that directory")

    def _path(self, name: str | None) -> Path:
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or name.startswith(".") \
                or len(name.encode()) > MAX_NAME_BYTES:
            raise Refused(ErrorKind.INVALID, f"field 'name' must be an adapter name (up to {MAX_NAME_BYTES} bytes of "
                                             "letters, digits, '.', '_', '-'; not starting with '.')", field="name")
        for candidate in (self.directory / name, self.directory / f"{name}.safetensors",
                          self.directory / f"{name}.ckpt", self.directory / f"{name}.pth"):
            # A link inside the directory may point anywhere: only what resolves inside counts.
            try:
                if candidate.exists() and candidate.resolve().is_relative_to(self.directory):
                    return candidate.resolve()
            except OSError:                   # never a message with the server's paths in it
                continue
        raise Refused(ErrorKind.INVALID, f"no LoRA adapter named {name!r} in the LoRA directory", field="name")

    # ------------------------------------------------------------------ slots (engine loop's thread)

    def load(self, adapter_file: AdapterFile) -> dict[str, Any]:
        self._configured()
        name = adapter_file.name
        with self._lock:
            if name in self._by_name:
                state = "being unloaded" if self._by_name[name].unloading else "loaded"
                raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r} is already {state}: unload it first",
                              field="name")
            taken = {a.slot for a in self._by_name.values()}
            free = [s for s in range(self.adapters.slots) if s not in taken]
            if not free:
                waiting = [a.name for a in self._by_name.values() if a.unloading]
                message = (f"all {self.adapters.slots} LoRA slots are taken ({sorted(self._by_name)}): unload one "
                           "first (--max-loras sets how many)")
                if waiting:
                    raise Refused(ErrorKind.BUSY, message + f"; {waiting} free when their streams end")
                raise Refused(ErrorKind.TOO_LARGE, message)
            slot = free[0]
        for module, layer in self.layers.items():
            a, b = adapter_file.weights.get(module, (None, None))
            layer.put(slot, a, b, adapter_file.scaling)
        self.adapters.scaling[slot] = adapter_file.scaling
        adapter = Adapter(name, slot, adapter_file.rank, adapter_file.scaling, len(adapter_file.loaded),
                          len(adapter_file.skipped))
        with self._lock:
            self._by_name[name] = adapter
        return {"name": name, "slot": slot, "rank": adapter.rank, "scaling": adapter.scaling,
                "loaded": adapter.loaded, "skipped": adapter.skipped,
                "skipped_keys": list(adapter_file.skipped[:8])}

    def unload(self, name: str | None) -> dict[str, Any]:
        """New streams may no longer use it; its slot frees once the streams using it end."""
        self._configured()
        if name is None:
            name = self.only_loaded()
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise self._unknown(name, "name")
            adapter.unloading = True
            if self.default == name:
                self.default = None
            streams = adapter.streams
            self._free_if_unused(adapter)
            unloaded = name not in self._by_name
        return {"name": name, "unloaded": unloaded, "streams_using": streams}

    def set_default(self, name: str | None) -> dict[str, Any]:
        """The adapter of streams that name none, from their start (`name` None: the one loaded)."""
        self._configured()
        if name is None:
            name = self.only_loaded()
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None or adapter.unloading:
                raise self._unknown(name, "name")
            self.default = name
        return {"default": self.default}

    def clear_default(self) -> dict[str, Any]:
        """Streams that name no adapter speak with the base model again."""
        self._configured()
        with self._lock:
            self.default = None
        return {"default": None}

    def unloading(self, pin: Any, name: str) -> bool:
        return isinstance(pin, Adapter) and pin.name == name and pin.unloading

    def only_loaded(self) -> str:
        """The one adapter loaded, for an operation that names none."""
        with self._lock:
            loaded = [a.name for a in self._by_name.values() if not a.unloading]
        if len(loaded) != 1:
            raise Refused(ErrorKind.INVALID, f"field 'name' is needed: {len(loaded)} adapters are loaded", field="name")
        return loaded[0]


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _check_range(name: str, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype) -> None:
    """Refuse weights that would overflow the serving dtype: as stored (cast to it), or in a
    forward pass, where `scaling * ||B|| * ||A||` bounds how much the layer can grow an
    activation (its spectral norm is at most that product of Frobenius norms). Finite but
    huge weights would turn the stream's audio into NaN."""
    top = torch.finfo(dtype).max
    if max(float(a.abs().max()), float(b.abs().max())) > top:
        raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r}: {module} holds values beyond what "
                                         f"{str(dtype).removeprefix('torch.')} can hold",
                      field="name")
    gain = abs(scaling) * float(torch.linalg.vector_norm(a.double())) * float(torch.linalg.vector_norm(b.double()))
    if gain * MAX_ACTIVATION_NORM > top:
        raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r}: {module} could grow an activation "
                                         f"{gain:.3g}-fold, past what the model's dtype holds: these are not "
                                         "the weights of a trained adapter", field="name")
