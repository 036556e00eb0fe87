"""Inputs replaced by a collective over them at the top of a forward: DDP's broadcast of rank 0's
buffers (BatchNorm statistics), local SGD's average of the parameters."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from dpar.core.facts import tensor_parallel_spec_of
from dpar.core.torch_internals import C10D_FUNCTIONAL
from dpar.compiler.graph_utils import with_code

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL


def broadcast_buffers_pass(
    gm: fx.GraphModule, buffer_indices: Sequence[int], *, group_name: str
) -> fx.GraphModule:
    """Replace the buffer inputs by rank 0's values, one flattened broadcast per dtype.

    Buffers the forward updates (running statistics) are then updated from rank
    0's values on every rank, which is what DDP does by broadcasting into the
    buffers before each forward.
    """
    return replace_inputs_by_collective(
        gm, buffer_indices, lambda graph, flat: graph.call_function(c10d.broadcast.default, (flat, 0, group_name))
    )


def average_inputs_pass(
    gm: fx.GraphModule,
    indices: Sequence[int],
    *,
    group_name: str,
    world_size: int,
    outer: tuple[float, float, bool] | None = None,
) -> fx.GraphModule:
    """Replace the inputs at ``indices`` by their average over the group, one flattened all-reduce per
    dtype, and write the results back into them (local SGD's parameter averaging).

    ``outer`` = (lr, momentum, nesterov): DiLoCo's outer step instead of the plain average. The
    graph takes two more inputs per averaged one, appended in order: its anchor (the parameters
    where the period began, the same on every rank) and its momentum; the outer gradient is
    anchor - average, the result anchor - lr x (Nesterov) momentum step, and anchor and momentum
    are updated in place.
    """

    def average(graph: fx.Graph, flat: fx.Node) -> fx.Node:
        scaled = graph.call_function(aten.div.Tensor, (flat, world_size))
        return graph.call_function(c10d.all_reduce.default, (scaled, "sum", group_name))

    then = None
    if outer is not None:
        lr, momentum, nesterov = outer
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_after(last):
            momenta = [gm.graph.placeholder(f"outer_momentum_{i}") for i in reversed(indices)][::-1]
        with gm.graph.inserting_after(last):
            anchors = [gm.graph.placeholder(f"outer_anchor_{i}") for i in reversed(indices)][::-1]
        position = {index: k for k, index in enumerate(indices)}

        def then(graph: fx.Graph, index: int, averaged: fx.Node) -> fx.Node:
            anchor, buffer = anchors[position[index]], momenta[position[index]]
            delta = graph.call_function(aten.sub.Tensor, (anchor, averaged))
            moved = graph.call_function(aten.add.Tensor, (graph.call_function(aten.mul.Tensor, (buffer, momentum)), delta))
            step = graph.call_function(aten.add.Tensor, (delta, graph.call_function(aten.mul.Tensor, (moved, momentum)))) \
                if nesterov else moved
            new = graph.call_function(aten.sub.Tensor, (anchor, graph.call_function(aten.mul.Tensor, (step, lr))))
            graph.call_function(aten.copy_.default, (buffer, moved))
            graph.call_function(aten.copy_.default, (anchor, new))
            return new

    return replace_inputs_by_collective(gm, indices, average, write_back=True, then=then)


def replace_inputs_by_collective(
    gm: fx.GraphModule,
    indices: Sequence[int],
    collective: Callable[[fx.Graph, fx.Node], fx.Node],
    *,
    write_back: bool = False,
    then: Callable[[fx.Graph, int, fx.Node], fx.Node] | None = None,
) -> fx.GraphModule:
    """At the top of the graph, each dtype's inputs among ``indices`` flattened into one tensor,
    ``collective`` issued on it, and every later use of an input reading its part of the result
    (or what ``then(graph, index, part)`` makes of it). ``write_back`` also copies the result
    into the input tensors themselves."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs = [placeholders[i] for i in indices]
    index_of = dict(zip(inputs, indices))
    by_dtype: dict[torch.dtype, list[fx.Node]] = {}
    for node in inputs:
        by_dtype.setdefault(node.meta["val"].dtype, []).append(node)
    anchor = placeholders[-1]
    for nodes in by_dtype.values():
        shapes = [list(n.meta["val"].shape) for n in nodes]
        numels = [n.meta["val"].numel() for n in nodes]
        with graph.inserting_before(anchor.next):
            flats = [graph.call_function(aten.view.default, (n, [k])) for n, k in zip(nodes, numels)]
            flat = flats[0] if len(flats) == 1 else graph.call_function(aten.cat.default, (flats,))
            sent = collective(graph, flat)
            waited = graph.call_function(c10d.wait_tensor.default, (sent,))
            pieces = graph.call_function(aten.split_with_sizes.default, (waited, numels))
            received = [
                graph.call_function(
                    aten.view.default, (graph.call_function(operator.getitem, (pieces, i)), shape)
                )
                for i, shape in enumerate(shapes)
            ]
            if then is not None:
                received = [then(graph, index_of[n], value) for n, value in zip(nodes, received)]
        for node, value in zip(nodes, received):
            node.replace_all_uses_with(value, delete_user_cb=lambda user: user not in flats)
        anchor = received[-1]
        if write_back:
            for node, value in zip(nodes, received):
                with graph.inserting_after(anchor):
                    anchor = graph.call_function(aten.copy_.default, (node, value))
    graph.lint()
    return with_code(gm)


def buffer_broadcast_groups(
    buffers: Sequence[tuple[int, torch.Tensor]], *, whole_group: str, split_group: str | None
) -> dict[str, list[int]]:
    """Group name -> positions of the buffers broadcast from its rank 0.

    DDP hands every rank rank 0's buffers. A buffer tensor parallel splits holds a
    different block on each rank of its group, so it is broadcast only over the
    data-parallel group (``split_group``; None where there is none).
    """
    groups: dict[str, list[int]] = {}
    for position, value in buffers:
        split = getattr(tensor_parallel_spec_of(value), "dim", None) is not None
        group = split_group if split else whole_group
        if group is not None:
            groups.setdefault(group, []).append(position)
    return groups
