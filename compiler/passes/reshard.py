"""FSDP's reshard-after-forward, as a tag on the joint graph for the partitioner."""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from dpar.compiler.passes.all_gather import c10d, shard_source


def tag_gathers_for_recompute(joint: fx.GraphModule) -> fx.GraphModule:
    """Mark every gathered parameter, and what is computed from it alone, as must-recompute.

    The partitioner then saves the shard (a graph input, free to keep) instead
    of the full parameter, and the backward graph gathers it again: the full
    parameter lives only from its gather to its last use in each graph.
    """
    derived: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if node.target is c10d.all_gather_into_tensor.default:
            source, chain = shard_source(node.args[0]), [node]
            while chain[-1].all_input_nodes and chain[-1].all_input_nodes[0] is not source:
                chain.append(chain[-1].all_input_nodes[0])
            derived.update(chain)
        elif node.op == "call_function" and node.all_input_nodes and all(a in derived for a in node.all_input_nodes):
            derived.add(node)
    for node in derived:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return joint
