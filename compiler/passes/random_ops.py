"""Activation checkpointing under the sharded strategies: random ops are saved, not recomputed.

[Note: checkpointed random ops and saved DeviceMeshes]
A sharded parameter enters the graph as a DTensor, which AOTAutograd flattens
into its local shard and its DeviceMesh, an opaque input; the backward returns
DTensor gradients, so the mesh is saved for it. A random op inside a
checkpointed region (dropout; CPU scaled-dot-product attention is tagged random
too) would be recomputed in the backward, so the partitioner saves the RNG state
it ran with (``run_and_save_rng_state``) and appends that state after every
saved value but the SymInts, that is after the mesh. The runtime expects saved
tensors before saved opaque objects, so its slice of tensors takes the mesh:
"expected all tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh".
Reordering the two graphs afterwards is not enough: AOTAutograd records
positions of the saved values before dpar's hooks see them.

So under a sharded strategy a random op in a checkpointed region is saved
rather than recomputed (torchtitan's selective checkpointing saves attention
the same way): no RNG state is saved, the rest of the region is recomputed,
and the numbers are those of recomputation with the replayed state.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from dpar.core.torch_internals import must_recompute


def is_random(node: fx.Node) -> bool:
    """A node that draws from the RNG (dropout, ``rand*``, ``bernoulli``; torch tags CPU attention so too)."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def with_outputs(node: fx.Node) -> list[fx.Node]:
    """``node`` and, for a tuple-valued op, the getitems that carry its outputs (what a save tag must cover)."""
    return [node, *(u for u in node.users if u.target is operator.getitem)]


def save_random_ops(joint: fx.GraphModule) -> fx.GraphModule:
    """Re-tag every random op the partitioner would recompute, and the getitems of its outputs,
    prefer-save: untagged, a random op is never recomputed, so what the backward needs of it is
    saved (a tuple-valued op cannot be must-save itself). See the Note above."""
    for node in joint.graph.nodes:
        if must_recompute(node) and is_random(node):
            for saved in with_outputs(node):
                saved.meta["recompute"] = CheckpointPolicy.PREFER_SAVE
    return joint
