"""The engine registry: which engines exist, how each is built, and which `auto` picks.

An engine is one module that defines `PLUGIN = EnginePlugin(...)`, plus its line in `BUILT_IN`.
The command line's `--engine` choices and engine settings, `auto`, and the option vocabulary
that front doors validate against all come from here. Plugin modules must import cheaply (no
torch, no model libraries at module level): the registry imports every one of them.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..engine import Engine, OptionSpec

log = logging.getLogger("vox_ws.engines")

# The engines a plain install offers, by module.
BUILT_IN = (
    "vox_ws.engines.piper",
    "vox_ws.engines.voxcpm",
)


def parse_count(text: str) -> int | None:
    """A count setting that may also be `auto` (None: sized once the engine has loaded)."""
    if text == "auto":
        return None
    value = int(text)
    if value < 1:
        raise ValueError("at least 1, or auto")
    return value


def parse_bool(text: str) -> bool:
    """A boolean setting from the command line or the environment."""
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


@dataclass(frozen=True)
class Setting:
    """A server setting that belongs to one engine: `--NAME` on the command line, VOX_WS_NAME."""

    name: str                       # with dashes, e.g. "lora-rank"
    kind: Callable[[str], Any]
    default: Any
    help: str
    # Given more than once (`--NAME A --NAME B`; the environment's value comma-separated): a list.
    many: bool = False

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")


@dataclass(frozen=True)
class EnginePlugin:
    name: str
    summary: str
    # Builds the engine (not loaded) from the common settings (device, threads, slots) and
    # the plugin's own, by key.
    create: Callable[[dict[str, Any]], Engine]
    # The generation options the engine honours (for validation before it is even loaded).
    options: Mapping[str, OptionSpec] = field(default_factory=dict)
    settings: tuple[Setting, ...] = ()
    # `auto` tries plugins with a priority, highest first, and takes the first whose probe says
    # yes; None: never chosen by `auto`.
    auto_priority: int | None = None
    probe: Callable[[dict[str, Any]], tuple[bool, str]] | None = None
    # When `auto` passes over this plugin (its probe's reason given): a line for the operator
    # if what it would serve is within reach (a GPU without weights: the command that gets
    # them), else None. Logged, and kept on the engine that serves instead (`Engine.notice`).
    notice: Callable[[dict[str, Any], str], str | None] | None = None
    # Modules an engine process imports once, in the fork server every engine process is forked
    # from (torch, the model's package): a restart starts without importing them again.
    preload: tuple[str, ...] = ()


COMMON_SETTINGS = (
    Setting("device", str, "auto", "auto, cuda, cuda:N, cpu or mps (engines that run on a device); several, "
                                    "comma-separated (cuda:0,cuda:1), or cuda:all: one model and engine loop each"),
    Setting("threads", int, 1, "CPU threads for the model (torch / ONNX Runtime)"),
)

_plugins: dict[str, EnginePlugin] = {}
_unavailable: dict[str, str] = {}
_loaded = False


def register(plugin: EnginePlugin) -> None:
    """Add (or replace) an engine. Tests and benchmarks register their own this way."""
    _plugins[plugin.name] = plugin


def unregister(name: str) -> None:
    _plugins.pop(name, None)


def plugins() -> dict[str, EnginePlugin]:
    _load_built_in()
    return dict(_plugins)


def option_vocabulary(engine: Engine | None = None) -> dict[str, OptionSpec]:
    """Every generation option some registered engine honours (a served engine's own specs win):
    the options a front door validates, then reports ignored where the engine does not use them."""
    vocabulary: dict[str, OptionSpec] = {}
    for plugin in plugins().values():
        for name, spec in plugin.options.items():
            vocabulary.setdefault(name, spec)
    if engine is not None:
        vocabulary.update(engine.options)
    return vocabulary


def create_engine(name: str, settings: dict[str, Any]) -> Engine:
    """Build the named engine (not loaded yet); `auto` picks one and logs why."""
    available = plugins()
    notices: list[str] = []
    if name == "auto":
        name, why, notices = choose_auto(settings)
        log.info("engine auto -> %s (%s)", name, why)
        for notice in notices:
            log.warning("%s", notice)
    plugin = available.get(name)
    if plugin is None:
        why = f": {_unavailable[name]}" if name in _unavailable else ""
        raise ValueError(f"unknown engine {name!r}{why} (choose from auto, {', '.join(sorted(available))})")
    engine = plugin.create(settings)
    engine.notice = " ".join(notices)
    return engine


def choose_auto(settings: dict[str, Any]) -> tuple[str, str, list[str]]:
    """(the plugin `auto` takes, why, the notices of those it passed over)."""
    reasons, notices = [], []
    candidates = [p for p in plugins().values() if p.auto_priority is not None]
    for plugin in sorted(candidates, key=lambda p: -p.auto_priority):
        ok, why = plugin.probe(settings) if plugin.probe else (True, "available")
        if ok:
            return plugin.name, "; ".join(reasons + [why]), notices
        reasons.append(f"not {plugin.name}: {why}")
        notice = plugin.notice(settings, why) if plugin.notice else None
        if notice:
            notices.append(notice)
    raise ValueError("no engine can run here: " + "; ".join(reasons))


def _load_built_in() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module_name in BUILT_IN:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            _unavailable[module_name.rsplit(".", 1)[-1]] = f"{type(exc).__name__}: {exc}"
            continue
        _plugins.setdefault(module.PLUGIN.name, module.PLUGIN)
