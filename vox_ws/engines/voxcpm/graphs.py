"""Compiled graphs kept on disk, so that a second start loads them instead of compiling.

`torch.compile` with a warm inductor cache still traces every function with dynamo at each
start (some 2 s a graph on a small CPU; a step has three graphs per batch bucket). PyTorch's
precompile (`torch.compile(...).aot_compile`, saved with `save_compiled_function`, read back
with `torch.compiler.load_compiled_function`) skips the tracing: loading a graph takes
milliseconds once inductor is imported.

A saved graph keeps no dynamo guards: guards on modules cannot be saved (keeping them would
pickle the weights into every file), so this store keeps the two promises guards would:
- a file is used only for the same code and shapes: its name is a digest of PyTorch's,
  Python's, vox-ws's and voxcpm's versions, the source of the modules the graphs trace, the
  shape and dtype of every parameter and buffer of the modules passed in, and the shapes,
  dtypes and devices of the arguments;
- every call is checked against the shapes and dtypes it was compiled for (a dynamic size
  anything of at least 2), and refused with `GraphMismatch` otherwise.

Precompile is switched on where this PyTorch has it behind a flag
(`torch._dynamo.config.enable_aot_compile`: off by default in torch 2.11, on in 2.13). Where it
cannot be had, a store that compiles falls back to `torch.compile` (traced at each start, guarded
as usual, nothing saved) and says so once in the log; a store that only loads refuses at once
(`PrecompileUnavailable`): it would otherwise compile in the serving process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import inspect
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

log = logging.getLogger("vox_ws.engines.voxcpm")


# How long a process waits for another compiling the graph it wants (a graph of the real model
# compiles in minutes on a GPU): past it, it compiles the graph itself.
LOCK_WAIT_S = 900.0


class GraphMismatch(RuntimeError):
    """A compiled graph was called with arguments of other shapes than it was compiled for."""


class GraphMissing(RuntimeError):
    """A store that only loads was asked for a graph no one has compiled into it."""


class PrecompileUnavailable(RuntimeError):
    """This PyTorch cannot save or load compiled graphs, and the store was asked only to load."""


def precompile_available() -> bool:
    """Whether compiled graphs can be saved and loaded here: `aot_compile` exists, with its
    flag switched on where this PyTorch keeps one (torch 2.11 has it off by default)."""
    config = torch._dynamo.config
    if hasattr(config, "enable_aot_compile") and not config.enable_aot_compile:
        config.enable_aot_compile = True
    return (hasattr(torch.compile(lambda: None), "aot_compile")
            and hasattr(torch.compiler, "load_compiled_function")
            and bool(getattr(config, "enable_aot_compile", True)))


def module_signature(*modules: nn.Module) -> str:
    """The modules' structure (their repr: layers, sizes, strides) and the names, shapes and
    dtypes of every parameter and buffer: what a graph's code depends on of the modules (the
    weights' values are inputs, read at each call)."""
    parts = [repr(module) for module in modules]
    for module in modules:
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            parts.append(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.device.type}")
    return "\n".join(parts)


def _versions() -> str:
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "-"
    from ... import __version__

    return (f"torch {torch.__version__} cuda {torch.version.cuda} triton {version('triton')} python {sys.version} "
            f"vox-ws {__version__} voxcpm {version('voxcpm')}")


def _device_architecture(args: tuple) -> str:
    """The GPU the graphs are compiled for (its kernels are built for its architecture), by its
    tensors' device: name and compute capability; "" on a CPU."""
    for value in args:
        tensors = value if isinstance(value, (tuple, list)) else [value]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
                major, minor = torch.cuda.get_device_capability(tensor.device)
                return f"{torch.cuda.get_device_name(tensor.device)} sm_{major}{minor}"
    return ""


def _argument_indexes(fn: Callable, names: Mapping[str, int]) -> dict[int, int]:
    """`names` (a parameter of `fn` -> a value) keyed by the parameter's position instead; a
    name `fn` does not take is an error, so a renamed parameter cannot silently point elsewhere."""
    parameters = list(inspect.signature(fn).parameters)
    unknown = set(names) - set(parameters)
    if unknown:
        raise TypeError(f"{getattr(fn, '__name__', fn)} takes no parameter {sorted(unknown)}")
    return {parameters.index(name): value for name, value in names.items()}


def mark_dynamic(fn: Callable, args: tuple, dynamic: Mapping[str, int] | None) -> dict[int, int]:
    """Mark the sizes `dynamic` names (a parameter of `fn` -> that tensor's dynamic dim, or every
    tensor's of a list) on `args` for dynamo; the marked dims by the tensors' ids."""
    marked = {}
    for index, dim in _argument_indexes(fn, dynamic or {}).items():
        for tensor in args[index] if isinstance(args[index], (tuple, list)) else [args[index]]:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
            marked[id(tensor)] = dim
    return marked


def _describe(value: Any, dynamic: dict[int, int]) -> str:
    if isinstance(value, torch.Tensor):
        shape = tuple("s" if dynamic.get(id(value)) == dim else size for dim, size in enumerate(value.shape))
        return f"tensor{shape}:{value.dtype}:{value.device}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_describe(v, dynamic) for v in value) + ")"
    if isinstance(value, (int, float, bool, str)) or value is None:
        return repr(value)
    return type(value).__qualname__


class SavedGraph:
    """A loaded (or just compiled) graph, checking each call's tensors against its own."""

    def __init__(self, name: str, fn: Callable, args: tuple, dynamic: dict[int, int]) -> None:
        self.name = name
        self._fn = fn
        self._expected = [self._spec(a, dynamic) for a in args]

    @staticmethod
    def _spec(value: Any, dynamic: dict[int, int]) -> Any:
        if isinstance(value, torch.Tensor):
            shape = tuple(None if dynamic.get(id(value)) == dim else size for dim, size in enumerate(value.shape))
            return (shape, value.dtype, value.is_contiguous())
        if isinstance(value, (tuple, list)):
            return [SavedGraph._spec(v, dynamic) for v in value]
        return None

    def _fits(self, value: Any, expected: Any) -> bool:
        if isinstance(expected, tuple):
            shape, dtype, contiguous = expected
            return (isinstance(value, torch.Tensor) and value.dtype == dtype and value.dim() == len(shape)
                    and value.is_contiguous() == contiguous
                    and all(want == got if want is not None else got >= 2 for want, got in zip(shape, value.shape)))
        if isinstance(expected, list):
            return (isinstance(value, (tuple, list)) and len(value) == len(expected)
                    and all(self._fits(v, e) for v, e in zip(value, expected)))
        return True

    def __call__(self, *args: Any) -> Any:
        if len(args) != len(self._expected):
            raise GraphMismatch(f"compiled graph {self.name}: {len(args)} arguments, compiled for "
                                f"{len(self._expected)}")
        for index, (value, expected) in enumerate(zip(args, self._expected)):
            if not self._fits(value, expected):
                raise GraphMismatch(f"compiled graph {self.name}: argument {index} is not of the shape, dtype or "
                                    f"layout it was compiled for ({expected})")
        return self._fn(*args)


class GraphStore:
    """Compiled graphs by name, context and arguments, in `directory`. A graph's context names
    what else it depends on (the model's config, how the runner built its modules): graphs of
    one context are shared by every process compiling into the same directory."""

    def __init__(self, directory: Path, sources: str = "", load_only: bool = False,
                 lock_wait_s: float = LOCK_WAIT_S) -> None:
        """`sources`: the source code the graphs trace through, beside the modules passed in
        (their caller's: a change to it is a new key); `load_only`: never compile (a graph not on
        the disk is `GraphMissing`): a serving process loads what a background compile made.
        `lock_wait_s`: how long to wait for
        another process compiling the same graph before compiling it too."""
        self.directory = Path(directory) / "graphs"
        self.load_only = load_only
        self.lock_wait_s = lock_wait_s
        self.sources = sources
        self.waiting_on: Path | None = None     # the lock this store waits for, while it does
        self.directory.mkdir(parents=True, exist_ok=True)
        self._base = None
        self.loaded = 0       # graphs read from the disk
        self.compiled = 0     # graphs compiled (and saved, where they could be)
        self.seconds: list[tuple[str, str, float]] = []   # (graph, "loaded" or "compiled", seconds)
        self.precompile = precompile_available()
        if not self.precompile:
            if load_only:
                raise PrecompileUnavailable(f"torch {torch.__version__} cannot load saved graphs (no precompile): "
                                            "a store that only loads would compile in this process")
            log.warning("torch %s cannot save compiled graphs (no precompile): the step is compiled at each start "
                        "and nothing is kept in %s", torch.__version__, self.directory)

    def graph(self, name: str, fn: Callable, args: tuple, *, context: str,
              dynamic: Mapping[str, int] | None = None) -> Callable:
        """`fn` compiled (fullgraph, shapes fixed but for `dynamic`: a parameter's name -> that
        tensor's dynamic dim, or every tensor's of a list) for arguments like `args`: loaded from
        the disk when it was compiled before, else compiled now and saved."""
        marked = mark_dynamic(fn, args, dynamic)
        if not self.precompile:
            self.compiled += 1
            return torch.compile(fn, fullgraph=True, dynamic=False)
        path = self.path(name, context, args, marked)
        if self.load_only:
            graph = self._load(name, path, args, marked, timed=True)
            if graph is None:
                raise GraphMissing(f"compiled graph {name} for {_rows(args)} rows is not in {self.directory}")
            return graph
        # One process compiles a graph; another that wants it meanwhile (the decoder process, a
        # second server on the same cache) waits for it and loads it; for a bounded time, then it
        # compiles it too (a save replaces the file whole: two saves cannot mix).
        with self._locked(path.with_suffix(".lock")):
            graph = self._load(name, path, args, marked, timed=True)
            if graph is None:
                started = time.perf_counter()
                graph = self._compile(name, fn, path, args, marked)
                self.seconds.append((f"{name}:{_rows(args)}", "compiled", round(time.perf_counter() - started, 3)))
            return graph

    def path(self, name: str, context: str, args: tuple, dynamic: dict[int, int]) -> Path:
        """Where the graph `name` for `args` is kept (`dynamic` as `graph` turns it: by id)."""
        return self.directory / f"{name}-{self._digest(name, context, args, dynamic)}.pt2"

    def _load(self, name: str, path: Path, args: tuple, dynamic: dict[int, int], timed: bool = False
              ) -> SavedGraph | None:
        if not path.exists():
            return None
        started = time.perf_counter()
        try:
            with open(path, "rb") as f:
                loaded = torch.compiler.load_compiled_function(f)
        except Exception as exc:  # noqa: BLE001 - a stale or broken file: compile again
            log.warning("compiled graph %s unreadable (%s: %s): compiling it again", path.name,
                        type(exc).__name__, exc)
            return None
        self.loaded += 1
        if timed:
            self.seconds.append((f"{name}:{_rows(args)}", "loaded", round(time.perf_counter() - started, 3)))
        return SavedGraph(name, loaded, args, dynamic)

    def _compile(self, name: str, fn: Callable, path: Path, args: tuple, dynamic: dict[int, int]) -> Callable:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, options={"guard_filter_fn": _no_guards})
        self.compiled += 1
        try:
            precompiled = compiled.aot_compile((args, {}))
        except Exception as exc:  # noqa: BLE001 - this PyTorch cannot precompile it: trace at each start
            log.warning("graph %s cannot be precompiled (%s: %s): compiled at each start instead", name,
                        type(exc).__name__, exc)
            return torch.compile(fn, fullgraph=True, dynamic=False)
        # Written beside, then renamed over: a reader sees no file or a whole one, never a part.
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            precompiled.save_compiled_function(str(partial))
            os.replace(partial, path)
        except Exception as exc:  # noqa: BLE001 - it still serves this process
            log.warning("compiled graph %s not saved (%s: %s)", name, type(exc).__name__, exc)
            partial.unlink(missing_ok=True)
        return SavedGraph(name, precompiled, args, dynamic)

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        """An exclusive lock on `path` (created if missing) for the block, between processes; the
        system lets it go if the holder dies. Waited for `lock_wait_s` at most (`waiting_on`
        names it meanwhile): then the block runs without it, as a holder that hangs must not
        hang every start after it."""
        with open(path, "a+b") as f:
            deadline = time.monotonic() + self.lock_wait_s
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        self.waiting_on = None
                        log.warning("%s held for over %.0f s by another process: compiling without it", path.name,
                                    self.lock_wait_s)
                        yield
                        return
                    self.waiting_on = path
                    time.sleep(0.05)
            self.waiting_on = None
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _digest(self, name: str, context: str, args: tuple, dynamic: dict[int, int]) -> str:
        if self._base is None:
            self._base = "\n".join([_versions(), self.sources])
        modules = [a for a in args if isinstance(a, nn.Module)]
        text = "\n".join([self._base, _device_architecture(args), context, name, module_signature(*modules),
                          ",".join(_describe(a, dynamic) for a in args)])
        return hashlib.sha256(text.encode()).hexdigest()[:24]


class GraphsBySize:
    """`fn` through one graph per batch size (the rows of its parameter `rows_of`), each loaded
    or compiled from `store` on its first call with that size; where `dynamic` names `rows_of`'s
    first size too (a symbolic batch), one graph for a batch of 1 and one for every other.

    Per bucket, the same graph is compiled once per bucket: seven times at a cold compile's cost.
    A symbolic batch compiles it twice (dynamo specialises a size of 1, and the store's call
    check takes a symbolic size only from 2), and on this CPU the whole step through it runs as
    fast (`benchmarks/dynamic_batch.py`, docs/PERFORMANCE.md). It is for a `fn` whose batch
    enters through `rows_of` alone, where no operation needs the batch as a number: a
    convolution whose groups grow with the rows (the CPU's folded depthwise VAE) specialises it
    to the first batch compiled, and the graph then refuses every other, and the CPU's
    FlexAttention kernel does not compile with a symbolic batch: met at a batch size's first
    call, the graph falls back to one per batch size, with a warning."""

    def __init__(self, store: GraphStore, name: str, fn: Callable, *, context: str, rows_of: str,
                 dynamic: Mapping[str, int] | None = None) -> None:
        self.store, self.name, self.fn = store, name, fn
        self.context = context
        (self._rows_at,) = _argument_indexes(fn, {rows_of: 0})
        # The symbolic graph's dynamic sizes (its key differs from every bucket's: the store
        # never takes one for the other), and the sizes of a graph of one batch size.
        self._symbolic = dict(dynamic) if dynamic and dynamic.get(rows_of) == 0 else None
        per_size = {k: v for k, v in (dynamic or {}).items() if k != rows_of or self._symbolic is None}
        self.dynamic = per_size or None
        self._graphs: dict[int, Callable] = {}
        self._proven: set[int] = set()      # batch sizes the symbolic graph has served

    def __call__(self, *args: Any) -> Any:
        rows = args[self._rows_at].shape[0]
        if self._symbolic is None or rows < 2 or rows in self._proven:
            return self.load(*args)(*args)
        try:
            out = self.load(*args)(*args)
        except Exception as exc:  # noqa: BLE001 - the graph per batch size is tried next; its error is raised
            # Not symbolic after all: this device's compiler needed the batch as a number (a
            # compile error, or a graph specialised to the first batch that checks its inputs'
            # sizes before it computes anything). A graph per batch size from now on. A batch
            # size's first call is the warm-up's, on padding rows: never a live step's.
            log.warning("graph %s is not symbolic in its batch (%s: %s): a graph per batch size instead",
                        self.name, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            self._symbolic = None
            self._graphs.pop(SYMBOLIC_ROWS, None)
            # The rows' tensor keeps the symbolic graph's mark on its batch: a copy has none.
            args = (*args[:self._rows_at], args[self._rows_at].clone(), *args[self._rows_at + 1:])
            return self.load(*args)(*args)
        self._proven.add(rows)
        return out

    def load(self, *args: Any) -> Callable:
        """The graph for `args`' batch size, loaded or compiled now where it is not yet: a caller
        that must not wait on the disk later (a thread that decodes) has it loaded ahead."""
        rows = args[self._rows_at].shape[0]
        key = SYMBOLIC_ROWS if self._symbolic is not None and rows >= 2 else rows
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self.store.graph(self.name, self.fn, args, context=self.context,
                                                         dynamic=self.dynamic_for(rows))
        return graph

    def dynamic_for(self, rows: int) -> dict[str, int] | None:
        """The symbolic sizes of the graph a call of `rows` rows goes through (`load`)."""
        return self._symbolic if self._symbolic is not None and rows >= 2 else self.dynamic


# `GraphsBySize`'s key of its one graph for every batch of at least 2 rows.
SYMBOLIC_ROWS = -1


def bucket_of(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The batch size a call of `rows` rows runs at: the smallest bucket that holds it (None:
    over the largest). The one bucket rule of the step and the decode."""
    return next((size for size in sorted(buckets) if size >= rows), None)


def padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with its last row repeated up to `rows` rows: the one padding rule of a call up
    to its bucket (a padding row's outputs are dropped; it computes what a real row would)."""
    extra = rows - tensor.shape[0]
    if extra <= 0:
        return tensor
    return torch.cat([tensor, tensor[-1:].expand(extra, *tensor.shape[1:])])


def _rows(args: tuple) -> int:
    """The rows of a graph's first tensor argument (its batch size), for the timings."""
    return next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()), 0)


def _no_guards(entries: list) -> list[bool]:
    # What guards would check, `GraphStore` checks itself (see the module's docstring).
    return [False] * len(entries)
