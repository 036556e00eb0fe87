"""Small FX helpers the passes and the pipeline share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dpar.core.torch_internals import FakeTensorMode, detect_fake_mode, graph_module, stable_topological_sort


_code_deferred = 0  # how many ``code_written_after`` blocks are open


@contextlib.contextmanager
def code_written_after() -> Iterator[None]:
    """Passes run inside the block leave their graph's Python code unwritten, for the caller to write once after the
    last (``run_passes``): writing it took about half a second a pass on the backward of a tensor-parallel copy of
    Llama-3-70B's blocks, and passes read the graph, not the code."""
    global _code_deferred
    _code_deferred += 1
    try:
        yield
    finally:
        _code_deferred -= 1


def with_code(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its Python code written for its graph, as a pass returns it (see ``code_written_after``)."""
    if not _code_deferred:
        gm.recompile()
    return gm


def call(graph: fx.Graph, target: object, *args: object, **kwargs: object) -> fx.Node:
    """``graph.call_function`` spelled as the call it makes (at the graph's insertion point)."""
    return graph.call_function(target, args, kwargs)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """An independent graph to rewrite; node metadata (fake values) is shared, not cloned."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return graph_module(gm, graph)


def view_contiguous(graph: fx.Graph, node: fx.Node, shape: list[int]) -> fx.Node:
    """A view of ``node`` as ``shape``, after a contiguous copy if its layout needs one."""
    val = node.meta.get("val")
    if val is not None and not val.is_contiguous():
        node = graph.call_function(
            torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format}
        )
    return graph.call_function(torch.ops.aten.view.default, (node, shape))


def restore_topological_order(graph: fx.Graph) -> None:
    """Move nodes a rewrite left before their inputs down, keeping every other node in place."""

    stable_topological_sort(graph)


def refresh_fake_values(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Give every node a fresh ``meta['val']`` from ``example_inputs``: the values a pass changed or added, which
    Inductor and our tables read (a view shares its base's storage, every other value has its own).

    Each op is called once under the inputs' fake mode and ``no_grad``, giving the detached values ``FakeTensorProp``
    records; its interpreter, and a detach after each op, took twice the time on the forward and backward graphs of a
    tensor-parallel copy of Llama-3-70B's blocks (2026-12-01). It still takes a graph with attributes (a subgraph's
    module) or sizes bound by data (unbacked symbols), and inputs in no fake mode.
    """
    mode = detect_fake_mode(example_inputs)
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        FakeTensorProp(gm, mode).propagate(*example_inputs)
        return
    nodes = gm.graph.nodes
    if any(n.op not in _CALLED_DIRECTLY or "unbacked_bindings" in n.meta for n in nodes):
        with mode:
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*example_inputs)
        return
    inputs = iter(example_inputs)
    computed: dict[fx.Node, Any] = {}  # what each node returned, which its readers take (not only what is recorded)
    with mode, torch.no_grad():  # values, as FakeTensorProp records them: detached, no autograd graph
        for node in nodes:
            if node.op == "placeholder":
                value = next(inputs)
                value = value.detach() if isinstance(value, torch.Tensor) else value
            else:
                args, kwargs = fx.map_arg((node.args, node.kwargs), computed.__getitem__)
                value = node.target(*args, **kwargs) if node.op == "call_function" else args[0]
            computed[node] = value
            kept = fx.node.map_aggregate(value, _recorded_value)
            if kept is not None:  # as FakeTensorProp: a call that returns nothing keeps its value
                node.meta["val"] = kept


_CALLED_DIRECTLY = ("placeholder", "call_function", "output")


def _recorded_value(value: Any) -> Any:
    """What ``meta['val']`` holds of an op's result: tensors and sizes, not other Python objects."""
    return value if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) else None


def fill_fake_values(gm: fx.GraphModule) -> None:
    """Give only the nodes without a ``meta['val']`` one, computed from their inputs' values.

    For a pass whose next pass reads shapes alone and ends in ``refresh_fake_values``: a node copied with its
    metadata shares its original's value (the same storage), which a count of memory would take for one tensor.
    """
    mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder" and "val" in n.meta])
    with mode if mode is not None else FakeTensorMode(allow_non_fake_inputs=True):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "val" not in node.meta:
                args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
                node.meta["val"] = node.target(*args, **kwargs)


def fake_like(val: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous tensor in the same fake mode as ``val``."""
    mode = detect_fake_mode([val])
    if mode is None:
        return torch.empty(val.shape, dtype=val.dtype, device=val.device)
    with mode:
        return torch.empty(val.shape, dtype=val.dtype, device=val.device)
