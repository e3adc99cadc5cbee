"""The engine registry: which engines exist, how each is built, and which `auto` picks.

An engine is one module that defines `PLUGIN = EnginePlugin(...)`: a built-in one has its line in
`BUILT_IN`; another package's is an entry point of the group `vox_ws.engines` in that package's
metadata (`name = "module:PLUGIN"`, docs/ENGINES.md). The command line's `--engine` choices and
engine settings, `auto`, and the option vocabulary that front doors validate against all come
from here, and `installed()` lists every engine found, with why where one cannot be served.
Plugin modules must import cheaply (no torch, no model libraries at module level): the registry
imports every one of them, in the server's process too (the model's modules go in `preload`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
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
# The entry point group other packages declare their engines in.
ENTRY_POINT_GROUP = "vox_ws.engines"
# Names no plugin may take: `--engine auto` chooses among the others.
RESERVED_NAMES = frozenset({"auto"})


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

@dataclass(frozen=True)
class Installed:
    """An engine found at start: a built-in one or another package's (`source`: "built-in", or
    the distribution and its version), and why it cannot be served where it cannot (`error`)."""

    name: str
    source: str
    summary: str = ""
    error: str | None = None

    @property
    def available(self) -> bool:
        return self.error is None

    def describe(self) -> dict[str, Any]:
        """As `/v1/info`'s `engines` lists it."""
        return {"name": self.name, "source": self.source, "summary": self.summary,
                "available": self.available, "error": self.error}


_plugins: dict[str, EnginePlugin] = {}
_unavailable: dict[str, str] = {}
_found: list[Installed] = []
_loaded = False


def register(plugin: EnginePlugin) -> None:
    """Add (or replace) an engine. Tests and benchmarks register their own this way."""
    _plugins[plugin.name] = plugin


def unregister(name: str) -> None:
    _plugins.pop(name, None)


def plugins() -> dict[str, EnginePlugin]:
    _load_installed()
    return dict(_plugins)


def withdraw(name: str, why: str) -> None:
    """Take an engine found out of those served, listed with why (the command line's: another
    package's engine whose setting is already an option of the server)."""
    _load_installed()
    _plugins.pop(name, None)
    _unavailable[name] = why
    for n, found in enumerate(_found):
        if found.name == name and found.available:
            _found[n] = Installed(name, found.source, found.summary, error=why)


def installed() -> list[Installed]:
    """Every engine found (built-in, then other packages'), those that cannot be served with why."""
    _load_installed()
    return list(_found)


def unavailable() -> dict[str, str]:
    """The engines found that cannot be served, by name: why."""
    _load_installed()
    return dict(_unavailable)


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
        choices = f"choose from auto, {', '.join(sorted(available))}"
        if name in _unavailable:
            raise ValueError(f"engine {name!r} is installed but cannot be served: {_unavailable[name]} "
                             f"({choices})")
        raise ValueError(f"unknown engine {name!r} ({choices})")
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


def _load_installed() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module_name in BUILT_IN:
        short = module_name.rsplit(".", 1)[-1]
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            _refuse(short, "built-in", f"{type(exc).__name__}: {exc}")
            continue
        _plugins.setdefault(module.PLUGIN.name, module.PLUGIN)
        _found.append(Installed(module.PLUGIN.name, "built-in", module.PLUGIN.summary))
    for entry_point in _entry_points():
        _load_entry_point(entry_point)


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    """The group's entry points, by name (a name two distributions declare: both, in path order)."""
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda point: point.name)


def _load_entry_point(entry_point: importlib.metadata.EntryPoint) -> None:
    """One other package's engine, imported; one that cannot be served is listed with why, and
    never stops the start: its module's error, a name taken, or anything but an `EnginePlugin`."""
    name = entry_point.name
    distribution = entry_point.dist
    source = f"{distribution.name} {distribution.version}" if distribution is not None else entry_point.value
    taken = [found.source for found in _found if found.name == name and found.available]
    if taken or name in RESERVED_NAMES:
        holder = "the built-in engine" if taken and taken[0] == "built-in" else taken[0] if taken else ""
        why = f"its name is taken by {holder}" if taken else \
            f"{name!r} is reserved (--engine {name} chooses among the others)"
        _found.append(Installed(name, source, error=why))  # the name's engine is the one that has it
        return
    try:
        plugin = entry_point.load()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - another package's fault: listed, never fatal
        _refuse(name, source, f"{entry_point.value} failed to import: {type(exc).__name__}: {exc}")
        return
    if not isinstance(plugin, EnginePlugin):
        _refuse(name, source, f"{entry_point.value} is a {type(plugin).__name__}, not an EnginePlugin")
    elif plugin.name != name:
        _refuse(name, source, f"{entry_point.value} is the engine {plugin.name!r}: its entry point must "
                              "bear its name")
    else:
        _plugins.setdefault(name, plugin)
        _unavailable.pop(name, None)           # another package's engine of that name failed before
        _found.append(Installed(name, source, plugin.summary))


def _refuse(name: str, source: str, why: str) -> None:
    """An engine found that cannot be served, listed with why (`--engine NAME` is told it; the
    server's log says it at start). Nothing is logged here: the registry loads before logging is
    set up, and in every engine process again."""
    _unavailable[name] = why
    _found.append(Installed(name, source, error=why))
