"""tp and ddp+tp: the tensor-parallel pass on the joint graph, then (ddp+tp) DDP's passes over the data-parallel group."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group

from dpar.compiler.capture import GraphInput, InputKind
from dpar.compiler.data_parallel import broadcast_passes
from dpar.compiler.lowering import GraphRole, Lower
from dpar.compiler.options import Options
from dpar.compiler.graph_utils import refresh_fake_values
from dpar.compiler.passes.broadcast_buffers import buffer_broadcast_groups
from dpar.compiler.passes.group_batch import GroupBatch, unroll_group_batch
from dpar.compiler.passes.sink_waits import sink_waits_pass
from dpar.compiler.passes.tensor_parallel import tensor_parallel_pass
from dpar.compiler.pipeline import Pass, lower_checked, run_passes
from dpar.compiler.propagation.propagate import MeshDim
from dpar.runtime.tensor_parallel import TensorParallelSpec
from dpar.runtime.world import World

GraphHook = Callable[[fx.GraphModule, Sequence[Any], GraphRole, Lower], Callable[..., Any]]


def tensor_parallel_mesh(spec: TensorParallelSpec) -> MeshDim:
    group = _resolve_process_group(spec.group_name)
    return MeshDim(
        size=spec.tp_size, rank=dist.get_rank(group), group_name=spec.group_name,
        sequence_parallel=spec.sequence_parallel,
    )


class TensorParallelHook:
    """tp alone: the collectives are the ones the joint-graph passes inserted (the group's
    rows gathered and its gradients averaged inside the unrolled graph, or, for a user who
    feeds the group one batch, none), plus DDP's broadcast of rank 0's unsplit buffers."""

    def __init__(self, inputs: Sequence[GraphInput], world: World, options: Options) -> None:
        self.world, self.options = world, options
        buffers = [(i.index, i.tensor()) for i in inputs if i.kind is InputKind.BUFFER]  # no DTensor: index is position
        self.buffer_groups = buffer_broadcast_groups(buffers, whole_group=world.group_name, split_group=None)

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower
    ) -> Callable[..., Any]:
        passes = broadcast_passes(self.options, self.buffer_groups) if role is not GraphRole.BACKWARD else []
        if self.options.sink_waits:
            passes.append(("sink_waits", sink_waits_pass))
        gm = run_passes(gm, passes, role.value)
        return lower_checked(gm, example_inputs, f"{role.value} graph", lower, self.world, self.options)


class ThenInference:
    """Wraps another strategy's hook: a graph without backward (no joint graph to rewrite)
    gets the tensor-parallel pass first.

    ``group_batch`` (None where the user feeds the group identical rows) unrolls the
    graph once per rank of the group first: see [Note: the data contract under tensor
    parallel] in ``passes/group_batch.py``.
    """

    def __init__(self, mesh: MeshDim, hook: GraphHook, group_batch: GroupBatch | None) -> None:
        self.mesh, self.hook, self.group_batch = mesh, hook, group_batch

    def joint_passes(self) -> list[Pass]:
        passes: list[Pass] = []
        if self.group_batch is not None:
            passes.append(("unroll_group_batch", self._unrolled))
        return passes + [("tensor_parallel", lambda g: tensor_parallel_pass(g, self.mesh))]

    def _unrolled(self, joint: fx.GraphModule) -> fx.GraphModule:
        joint = unroll_group_batch(joint, self.group_batch)
        refresh_fake_values(joint, [n.meta["val"] for n in joint.graph.nodes if n.op == "placeholder"])
        return joint

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower
    ) -> Callable[..., Any]:
        if role is GraphRole.INFERENCE:
            gm = run_passes(gm, self.joint_passes(), role.value)
        return self.hook(gm, example_inputs, role, lower)
