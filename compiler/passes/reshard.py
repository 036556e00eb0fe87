"""FSDP's reshard-after-forward (and zero2's keeping), as tags on the joint graph for the partitioner."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from dpar.compiler.collectives import WAIT
from dpar.compiler.lowering import flat_inputs
from dpar.compiler.passes.all_gather import ParameterGroup, is_parameter_gather, operand_chain, shard_source


def tag_gathers(
    joint: fx.GraphModule, groups: Sequence[ParameterGroup], *, reshard_after_forward: bool
) -> fx.GraphModule:
    """Decide for the partitioner which gathered parameters the backward gathers again.

    With ``reshard_after_forward`` (fsdp, hsdp) every gathered parameter, and
    what is computed from it alone, is must-recompute: the partitioner then
    saves the shard (a graph input, free to keep) instead of the full
    parameter, and the backward graph gathers it again, so the full parameter
    lives only from its gather to its last use in each graph. The group
    gathered last in the forward is left gathered, as FSDP2 leaves its root
    unsharded: the backward starts with it, so gathering it again right away
    would only cost a collective.

    The gathers kept (all of zero2's, fsdp's last group) are must-save. Outside
    a checkpointed region the partitioner saves collectives anyway; inside one
    it would prefer to recompute them, gather included, which would undo
    zero2's point of keeping the gathered parameters for the backward.
    """
    primals = flat_inputs(joint.graph)
    group_of = {primals[i]: g.name for g in groups for i in g.inputs if i in primals}
    # Gathers of parameter shards only: tensor parallel's activation gathers are computed values.
    gathers = [
        n for n in joint.graph.nodes
        if is_parameter_gather(n) and shard_source(n.args[0]) in group_of
    ]
    last = group_of[shard_source(gathers[-1].args[0])] if gathers else None
    resharded = [g for g in gathers if reshard_after_forward and group_of[shard_source(g.args[0])] != last]
    tag_must_recompute(joint.graph, {n for g in resharded for n in operand_chain(g)})
    for gather in set(gathers) - set(resharded):
        for node in [gather, *(w for w in gather.users if w.target is WAIT)]:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
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
