"""Sequence parallel's memory: gather the token stream again in the backward instead of saving it whole.

Under sequence parallel the forward all-gathers a norm's output (held as
T/tp tokens) before each column-parallel layer. Left alone, the partitioner
saves that gathered tensor for the layer's weight gradient, and the activation
memory that sequence parallel was meant to save is spent again. Marking the
gather, the reshuffles around it (permutes, copies, and views: a one-row
batch's (1, T/tp, C) stream is gathered as (T/tp, C)) and what is computed from
it alone as must-recompute makes the partitioner save the shard instead; the
backward gathers it again (Megatron-SP does the same).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from dpar.compiler.lowering import tangents
from dpar.compiler.passes.reshard import tag_must_recompute
from dpar.core.torch_internals import C10D_FUNCTIONAL

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL

_RESHUFFLES = (aten.permute.default, aten.clone.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that read a tangent, directly or not: the joint graph's backward."""
    reached = set(tangents(graph))
    for node in graph.nodes:
        if any(a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


def _is_sequence_shard(node: fx.Node) -> bool:
    placement, val = node.meta.get("placement"), node.meta.get("val")
    return isinstance(placement, Shard) and isinstance(val, torch.Tensor) and val.ndim >= 3 and placement.dim == val.ndim - 2


def tag_sequence_gathers_for_recompute(gm: fx.GraphModule, group_name: str) -> fx.GraphModule:
    backward = _backward_nodes(gm.graph)
    seeds: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in backward or node.target is not c10d.all_gather_into_tensor.default or node.args[2] != group_name:
            continue
        chain, source = [node], node.args[0]
        while source.target in _RESHUFFLES and len(source.users) == 1:
            chain.append(source)
            source = source.args[0]
        if _is_sequence_shard(source):
            seeds.update(chain)
    tag_must_recompute(gm.graph, seeds)
    return gm
