"""Sharded parameters: one flattened all-gather per bucket instead of one per parameter."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx as fx

from dpar.compiler.collectives import WAIT
from dpar.compiler.lowering import flat_inputs
from dpar.compiler.propagation.redistribute import ACTIVATION_COLLECTIVE
from dpar.core.torch_internals import C10D_FUNCTIONAL
from dpar.compiler.graph_utils import with_code

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL


@dataclasses.dataclass(frozen=True)
class ParameterGroup:
    """Sharded parameters that share collectives.

    ``inputs`` are positions among AOTAutograd's flat forward inputs (a graph's
    placeholder for each is found by ``lowering.flat_inputs``, in the forward
    graph and, when saved, in the backward graph); ``gradients`` are the
    backward graph's outputs that hold those parameters' gradients.
    """

    name: str
    inputs: tuple[int, ...]
    gradients: tuple[int, ...]


def is_parameter_gather(node: fx.Node) -> bool:
    """An all-gather of a parameter's shards, not one tensor parallel inserted.

    Under fsdp+tp a tensor-parallel gather can read a gathered parameter (the
    propagation may gather a weight's blocks over the tp group rather than reduce
    an activation), so its operand leads back to the same shard through the fsdp
    gather: only the mark tells the two apart, never the shard they come from.
    """
    return node.target is c10d.all_gather_into_tensor.default and not node.meta.get(ACTIVATION_COLLECTIVE)


def shard_source(node: fx.Node) -> fx.Node:
    """The graph input a collective's operand comes from (through pads, views and casts)."""
    while node.op != "placeholder" and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return node


def operand_chain(node: fx.Node) -> list[fx.Node]:
    """``node`` and the nodes between it and the graph inputs it reads (pads, views, casts)."""
    chain, frontier = [node], [node]
    while frontier:
        for arg in frontier.pop().all_input_nodes:
            if arg.op != "placeholder" and arg not in chain:
                chain.append(arg)
                frontier.append(arg)
    return chain


def _numel(node: fx.Node) -> int:
    return int(node.meta["val"].numel())


def bucket_all_gathers_pass(
    gm: fx.GraphModule, groups: Sequence[ParameterGroup], *, group_name: str, world_size: int
) -> fx.GraphModule:
    """Replace the per-parameter gathers of each group by one gather of the concatenated shards.

    Rank r's shards are laid out back to back, so the gathered buffer is a
    [world, sum of shard sizes] matrix whose column block i is parameter i;
    each parameter is copied out of it right before its first use, and a
    parameter read twice (tied weights) is gathered once.
    """
    graph = gm.graph
    primals = flat_inputs(graph)
    gathers: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if is_parameter_gather(node):
            gathers.setdefault(shard_source(node.args[0]), []).append(node)
    for group in groups:
        members = [primals[i] for i in group.inputs if primals.get(i) in gathers]
        by_dtype: dict[torch.dtype, list[fx.Node]] = {}
        for shard in members:
            by_dtype.setdefault(gathers[shard][0].args[0].meta["val"].dtype, []).append(shard)
        for shards in by_dtype.values():
            _bucket(graph, [gathers[s] for s in shards], group_name, world_size)
    graph.eliminate_dead_code()
    graph.lint()
    return with_code(gm)


def _bucket(graph: fx.Graph, per_shard: list[list[fx.Node]], group_name: str, world_size: int) -> None:
    position = {n: i for i, n in enumerate(graph.nodes)}
    operands = [gs[0].args[0] for gs in per_shard]
    sizes = [_numel(op) for op in operands]
    first_gather = min((g for gs in per_shard for g in gs), key=position.__getitem__)
    for operand in operands:  # a later parameter's padding must exist before the bucket's gather
        for node in sorted(operand_chain(operand), key=position.__getitem__):
            if position[node] > position[first_gather]:
                first_gather.prepend(node)
    with graph.inserting_before(first_gather):
        flats = [graph.call_function(aten.view.default, (op, [k])) for op, k in zip(operands, sizes)]
        flat = flats[0] if len(flats) == 1 else graph.call_function(aten.cat.default, (flats,))
        gathered = graph.call_function(c10d.all_gather_into_tensor.default, (flat, world_size, group_name))
    old_waits = [w for gs in per_shard for g in gs for w in g.users if w.target is WAIT]
    first_use = min((u for w in old_waits for u in w.users), key=position.__getitem__)
    with graph.inserting_before(first_use):
        waited = graph.call_function(c10d.wait_tensor.default, (gathered,))
        matrix = graph.call_function(aten.view.default, (waited, [world_size, sum(sizes)]))
    offset = 0
    for gs, size in zip(per_shard, sizes):
        waits = [w for g in gs for w in g.users if w.target is WAIT]
        shape = list(gs[0].meta["val"].shape)
        first = min((u for w in waits for u in w.users), key=position.__getitem__)
        with graph.inserting_before(first):
            columns = graph.call_function(aten.slice.Tensor, (matrix, 1, offset, offset + size))
            packed = graph.call_function(aten.clone.default, (columns,), {"memory_format": torch.contiguous_format})
            full = graph.call_function(aten.view.default, (packed, shape))
        for w in waits:
            w.replace_all_uses_with(full)
            graph.erase_node(w)
        offset += size
    for g in {g for gs in per_shard for g in gs}:
        graph.erase_node(g)  # collectives are side-effectful: dead-code elimination keeps them
