"""Which FlexAttention kernel a graph's in-place attention is lowered to on a CUDA device.

Inductor lowers a FlexAttention call on a GPU to one of two Triton kernels: flex decoding (a
few query rows: the query heads of a KV head packed into one block, the keys split across the
multiprocessors) or the general kernel, which pads each (row, head)'s one query to a block of
128 and walks its keys unsplit. It takes the decoding kernel only where the query's batch and
heads are static sizes of the graph, among other conditions (`_use_flex_decoding` in
`torch/_inductor/kernel/flex/flex_decoding.py`, torch 2.11 as 2.13; pytorch PR #142816): a graph
with a symbolic batch gets the general kernel at every size it serves. Which one a graph gets
follows from its shapes alone, so it can be asked on any machine:

- `kernels_of(fn, args, dynamic)`: `fn` traced as the graph store marks it (dynamo alone, no
  compile, nothing run), and inductor's own `_use_flex_decoding` asked of each call's shapes, as
  its CUDA lowering asks it (the CPU's lowering never does: it has one kernel);
- `lowered()`: on a GPU, what the real lowering chose while a graph compiled there.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, Mapping

DECODING = "flex_decoding"
GENERAL = "flex_attention"


class _Traced(Exception):
    """Raised by the tracing backend instead of running the graph: the trace is all it wants."""


class _Sized:
    """A traced tensor as inductor's lowering reads it: its sizes as sympy expressions."""

    def __init__(self, tensor: Any) -> None:
        import sympy

        self._size = [sympy.Integer(size) if isinstance(size, int) else size.node.expr for size in tensor.shape]

    def get_size(self) -> list[Any]:
        return self._size


def _choice(node: Any, shape_env: Any) -> str:
    """The kernel inductor's CUDA lowering takes for one traced `flex_attention` call."""
    import sympy
    from torch._inductor.kernel.flex.flex_decoding import _use_flex_decoding
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    query, key, value = (node.args[index].meta["example_value"] for index in range(3))
    # The block mask as the lowering unpacks it: (q length, kv length, kv_num_blocks, kv_indices, ...).
    kv_indices = node.args[4][3].meta["example_value"]
    options = dict(node.args[6])
    backend = options.pop("BACKEND", "AUTO")      # what the lowering takes out before it asks
    sizes = SizeVarAllocator(shape_env)
    with V.set_graph_handler(types.SimpleNamespace(sizevars=sizes)):
        query_, key_ = _Sized(query), _Sized(key)
        gqa = sizes.evaluate_expr(sympy.Ne(query_.get_size()[1], key_.get_size()[1]))
        decoding = _use_flex_decoding(query_, _Sized(kv_indices), _Sized(value), options, gqa)
    if backend == "TRITON_DECODE" or (backend == "AUTO" and decoding):
        return DECODING
    return GENERAL


def kernels_of(fn: Callable, args: tuple, dynamic: Mapping[str, int] | None = None) -> list[str]:
    """The kernel (`DECODING` or `GENERAL`) inductor's CUDA lowering takes for each FlexAttention
    call of `fn(*args)` compiled as `graphs.GraphStore` compiles it (`fullgraph`, static but for
    `dynamic`: a parameter's name -> its tensor's dynamic dim, or every tensor's of a list), in
    call order; [] where it makes none. Traced on a copy of `fn`'s code, so no cache entry of
    `fn`'s own graphs is touched, and never run: nothing in `args` is written."""
    import torch

    from .graphs import mark_dynamic

    found: list[str] = []
    traced = []

    def backend(graph: Any, example_inputs: list[Any]) -> Callable:
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        shape_env = fake_mode.shape_env if fake_mode is not None else None
        for node in graph.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.higher_order.flex_attention:
                found.append(_choice(node, shape_env))
        traced.append(True)

        def stop(*_: Any) -> Any:
            raise _Traced()
        return stop

    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    mark_dynamic(fn, args, dynamic)
    try:
        with torch.inference_mode():
            torch.compile(copy, backend=backend, fullgraph=True, dynamic=False)(*args)
    except _Traced:
        pass
    if not traced:
        raise RuntimeError(f"{fn.__name__} was not traced (dynamo ran it uncompiled)")
    return found


@contextlib.contextmanager
def lowered() -> Iterator[list[str]]:
    """What inductor's CUDA lowering chose for each FlexAttention call it lowered in the block, in
    order (`DECODING` or `GENERAL`): a graph loaded from a cache, or lowered for a CPU, adds none."""
    from torch._inductor.kernel.flex import flex_attention as lowering

    chosen: list[str] = []
    asked = lowering._use_flex_decoding

    def recording(*args: Any, **kwargs: Any) -> bool:
        decoding = asked(*args, **kwargs)
        chosen.append(DECODING if decoding else GENERAL)
        return decoding

    lowering._use_flex_decoding = recording
    try:
        yield chosen
    finally:
        lowering._use_flex_decoding = asked


def summary(kernels: list[str]) -> str:
    """One graph's kernels in words: the one kernel every call takes, else each one's count."""
    if not kernels:
        return "none"
    if len(set(kernels)) == 1:
        return kernels[0]
    return ", ".join(f"{kernels.count(name)} {name}" for name in sorted(set(kernels)))
