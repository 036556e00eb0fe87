"""tp's passes: each rank's rows marked and unrolled over its group, then the tensor-parallel rewrite.

Which of them run, and in what order, is ``pass_listing.py``'s to say.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from dpar.compiler.capture import GraphInput, InputKind
from dpar.compiler.passes.group_batch import GroupBatch, mark_own_rows, unroll_group_batch
from dpar.compiler.passes.tensor_parallel import tensor_parallel_pass
from dpar.core.plan import AxisRole, ParallelPlan
from dpar.compiler.propagation.propagate import MeshDim
from dpar.core.world import world_of_group


class TensorParallel:
    """The tensor axis of a plan as the passes see it.

    ``group_batch`` (None where the user feeds the group identical rows) unrolls the
    graph once per rank of the group first: see [Note: the data contract under tensor
    parallel] in ``passes/group_batch.py``.
    """

    def __init__(self, inputs: Sequence[GraphInput], plan: ParallelPlan) -> None:
        axis = plan.axis(AxisRole.TENSOR)
        assert axis is not None, "a tensor-parallel plan has a tensor axis"
        rank = world_of_group(axis.group_name).rank
        self.mesh = MeshDim(size=axis.size, rank=rank, group_name=axis.group_name, sequence_parallel=plan.sequence_parallel)
        # Under cp too, the context axis moves the rows of both (compiler/context_parallel.py).
        moves_rows = not plan.same_batch_in_tp_group and not plan.strategy.context_parallel
        self.group_batch = GroupBatch(axis.size, rank, axis.group_name) if moves_rows else None
        self.data = [i.index for i in inputs if i.kind is InputKind.DATA]

    def mark_own_rows(self, gm: fx.GraphModule) -> fx.GraphModule:
        return mark_own_rows(gm, self.data)

    def unroll_group_batch(self, joint: fx.GraphModule) -> fx.GraphModule:
        assert self.group_batch is not None
        return unroll_group_batch(joint, self.group_batch)

    def tensor_parallel(self, joint: fx.GraphModule) -> fx.GraphModule:
        return tensor_parallel_pass(joint, self.mesh)
