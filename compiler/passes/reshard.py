"""FSDP's reshard-after-forward, as a tag on the joint graph for the partitioner."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from dpar.compiler.passes.all_gather import ParameterGroup, c10d, operand_chain, primal_placeholders, shard_source


def tag_gathers_for_recompute(joint: fx.GraphModule, groups: Sequence[ParameterGroup]) -> fx.GraphModule:
    """Mark every gathered parameter, and what is computed from it alone, as must-recompute.

    The partitioner then saves the shard (a graph input, free to keep) instead
    of the full parameter, and the backward graph gathers it again: the full
    parameter lives only from its gather to its last use in each graph.

    The group gathered last in the forward is left alone, as FSDP2 leaves its
    root unsharded: the backward starts with it, so gathering it again right
    away would only cost a collective.
    """
    primals = primal_placeholders(joint.graph)
    group_of = {primals[i]: g.name for g in groups for i in g.inputs if i in primals}
    # Gathers of parameter shards only: tensor parallel's activation gathers are computed values.
    gathers = [
        n for n in joint.graph.nodes
        if n.target is c10d.all_gather_into_tensor.default and shard_source(n.args[0]) in group_of
    ]
    kept = group_of[shard_source(gathers[-1].args[0])] if gathers else None
    tag_must_recompute(
        joint.graph, {n for g in gathers if group_of[shard_source(g.args[0])] != kept for n in operand_chain(g)}
    )
    return joint


def tag_must_recompute(graph: fx.Graph, seeds: set[fx.Node]) -> None:
    """Tag ``seeds`` and every node computed from them alone must-recompute: the partitioner then
    saves what the seeds were computed from, and the backward computes them again."""
    derived = set(seeds)
    for node in graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and all(a in derived for a in node.all_input_nodes):
            derived.add(node)
    for node in derived:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
