"""zero1's optimizer step graph: after the step, every rank's updated ranges into the whole parameters."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from dpar.compiler.collectives import WAIT
from dpar.core.facts import UpdatedRange
from dpar.core.torch_internals import C10D_FUNCTIONAL
from dpar.compiler.graph_utils import with_code

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL


def _graph_tensor(gm: fx.GraphModule, node: fx.Node, example_inputs: Sequence[Any]) -> Any:
    """The real tensor a graph input stands for: an attribute Dynamo installed, or an example input."""
    if node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    if node.op == "placeholder":
        position = [n for n in gm.graph.nodes if n.op == "placeholder"].index(node)
        return example_inputs[position] if position < len(example_inputs) else None
    return None


def all_gather_updated_ranges(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    ranges: Sequence[UpdatedRange],
    *,
    group_name: str,
    world_size: int,
) -> fx.GraphModule:
    """Append, after everything the step does, one all-gather per dtype of the ranges the graph reads.

    The graph's inputs are matched to ``ranges`` by tensor identity. Each rank sends its
    ranges back to back, each padded to ceil(numel / N) (every rank's range of a
    parameter has that length but the last), so the gathered buffer is an
    [N, sum of chunks] matrix whose column block i, read row after row, is parameter
    i's flattened elements; each is copied into its whole parameter. The rank's own
    range is copied too (the same values): one copy per parameter.
    """
    graph = gm.graph
    by_view = {id(r.view): r for r in ranges}
    read: dict[int, fx.Node] = {}
    for node in graph.nodes:
        tensor = _graph_tensor(gm, node, example_inputs)
        if isinstance(tensor, torch.Tensor) and id(tensor) in by_view and by_view[id(tensor)].view is tensor:
            read.setdefault(id(tensor), node)
    by_dtype: dict[torch.dtype, list[UpdatedRange]] = {}
    for r in ranges:  # the optimizer's order, the same on every rank
        if id(r.view) in read:
            by_dtype.setdefault(r.whole.dtype, []).append(r)
    output = graph.output_node()
    with graph.inserting_before(output):
        for dtype, members in by_dtype.items():
            _gather_into_wholes(gm, [(read[id(r.view)], r) for r in members], dtype, group_name, world_size)
    graph.lint()
    return with_code(gm)


def _gather_into_wholes(
    gm: fx.GraphModule, members: list[tuple[fx.Node, UpdatedRange]], dtype: torch.dtype, group_name: str, world_size: int
) -> None:
    graph = gm.graph
    chunks = [-(-r.whole.numel() // world_size) for _, r in members]
    padded = [
        graph.call_function(aten.constant_pad_nd.default, (node, [0, chunk - (r.hi - r.lo)])) if r.hi - r.lo < chunk else node
        for (node, r), chunk in zip(members, chunks)
    ]
    mine = graph.call_function(aten.cat.default, (padded,))
    mine.meta["val"] = torch.empty(sum(chunks), dtype=dtype, device="meta")  # what the collective tables read
    gathered = graph.call_function(c10d.all_gather_into_tensor.default, (mine, world_size, group_name))
    gathered.meta["val"] = torch.empty(world_size * sum(chunks), dtype=dtype, device="meta")
    waited = graph.call_function(WAIT, (gathered,))
    rows = graph.call_function(aten.view.default, (waited, [world_size, sum(chunks)]))
    columns = graph.call_function(aten.split_with_sizes.default, (rows, chunks, 1))
    for i, (_, r) in enumerate(members):
        name = f"dpar_whole_{str(dtype).removeprefix('torch.')}_{i}"
        setattr(gm, name, r.whole)
        whole = graph.get_attr(name)
        column = graph.call_function(operator.getitem, (columns, i))
        flat = graph.call_function(aten.reshape.default, (column, [-1]))
        elements = graph.call_function(aten.slice.Tensor, (flat, 0, 0, r.whole.numel()))
        graph.call_function(aten.copy_.default, (graph.call_function(aten.view.default, (whole, [-1])), elements))
