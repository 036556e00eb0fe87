"""Small FX helpers the passes and the pipeline share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dpar.core.torch_internals import FakeTensorMode, detect_fake_mode, graph_module, stable_topological_sort


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
    """Give the nodes a pass added their ``meta['val']``, which Inductor and our tables read."""
    mode = detect_fake_mode(example_inputs)
    if mode is None:

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        FakeTensorProp(gm, mode).propagate(*example_inputs)
    else:
        with mode:
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*example_inputs)


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
