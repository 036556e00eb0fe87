"""cp's passes: each rank's rows marked and unrolled over its group, its sequences marked, then the context-parallel rewrite.

Which of them run, and in what order, is ``pass_listing.py``'s to say.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from dpar.compiler.capture import GraphInput, InputKind
from dpar.compiler.passes.context_parallel import context_parallel_pass, mark_sequences, marked_length, sequence_length
from dpar.compiler.options import DDP_BUCKET_CAP_MB
from dpar.compiler.passes.gradient_reductions import bucket_returned_all_reduces
from dpar.compiler.passes.group_batch import GroupBatch, mark_own_rows, unroll_group_batch
from dpar.compiler.propagation.propagate import MeshDim
from dpar.core.plan import AxisRole, ParallelPlan
from dpar.core.world import world_of_group


class ContextParallel:
    """The context axis of a plan as the passes see it.

    Under DDP's data contract the group's rows are moved and the graph unrolled once per rank of the
    group, as tensor parallel does ([Note: the data contract under tensor parallel]): every rank then
    computes its chunks of every sequence of the group, so its activations are DDP's. ``group_batch`` is
    None where the user feeds the group identical rows, and each rank holds 1/cp of one copy's. With a
    tensor axis too, the rows are moved once over both (``ParallelPlan.rows_group``), or over the one
    whose ranks are fed different rows.
    """

    def __init__(self, inputs: Sequence[GraphInput], plan: ParallelPlan) -> None:
        axis = plan.axis(AxisRole.CONTEXT)
        assert axis is not None, "a context-parallel plan has a context axis"
        self.size, self.rank, self.group_name = axis.size, world_of_group(axis.group_name).rank, axis.group_name
        self.group_batch = _group_batch(plan)
        self.attention_exchange = plan.attention_exchange
        self.data = [i.index for i in inputs if i.kind is InputKind.DATA]

    def mark_inputs(self, gm: fx.GraphModule) -> fx.GraphModule:
        length = sequence_length(gm, self.data, self.size)
        if self.group_batch is not None:
            gm = mark_own_rows(gm, self.data)
        return mark_sequences(gm, self.data, length)

    def unroll_group_batch(self, joint: fx.GraphModule) -> fx.GraphModule:
        assert self.group_batch is not None
        return unroll_group_batch(joint, self.group_batch)

    def bucket_gradients(self, backward: fx.GraphModule) -> fx.GraphModule:
        return bucket_returned_all_reduces(backward, self.group_name, DDP_BUCKET_CAP_MB * 2**20)

    def context_parallel(self, joint: fx.GraphModule) -> fx.GraphModule:
        mesh = MeshDim(size=self.size, rank=self.rank, group_name=self.group_name, period=marked_length(joint),
                       attention_exchange=self.attention_exchange)
        return context_parallel_pass(joint, mesh)


def _group_batch(plan: ParallelPlan) -> GroupBatch | None:
    """The group whose ranks' rows each rank computes: cp's, tp's, both flattened, or none (all fed alike)."""
    moved = [] if plan.same_batch_in_cp_group else [plan.axis(AxisRole.CONTEXT)]
    if plan.strategy.tensor_parallel and not plan.same_batch_in_tp_group:
        moved.append(plan.axis(AxisRole.TENSOR))
    if not moved:
        return None
    axis = moved[0] if len(moved) == 1 else plan.rows_group
    assert axis is not None, "parallelize sets the flattened group of a plan with a cp and a tp axis"
    return GroupBatch(axis.size, world_of_group(axis.group_name).rank, axis.group_name)
