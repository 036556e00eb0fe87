"""tp and ddp+tp: the tensor-parallel pass on the joint graph, then (ddp+tp) DDP's passes over the data-parallel group."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group

from dpar.compiler.lowering import GraphRole, Lower
from dpar.compiler.options import Options
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
    """tp alone: every rank of the group sees the same batch, so no gradient needs reducing;
    the collectives are the ones the tensor-parallel pass inserted into the joint graph."""

    def __init__(self, world: World, options: Options) -> None:
        self.world, self.options = world, options

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower
    ) -> Callable[..., Any]:
        passes: list[Pass] = [("sink_waits", sink_waits_pass)] if self.options.sink_waits else []
        gm = run_passes(gm, passes, role.value)
        return lower_checked(gm, example_inputs, f"{role.value} graph", lower, self.world, self.options)


class ThenInference:
    """Wraps another strategy's hook: a graph without backward (no joint graph to rewrite)
    gets the tensor-parallel pass first."""

    def __init__(self, mesh: MeshDim, hook: GraphHook) -> None:
        self.mesh, self.hook = mesh, hook

    def joint_pass(self, joint: fx.GraphModule) -> fx.GraphModule:
        return tensor_parallel_pass(joint, self.mesh)

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower
    ) -> Callable[..., Any]:
        if role is GraphRole.INFERENCE:
            gm = tensor_parallel_pass(gm, self.mesh)
        return self.hook(gm, example_inputs, role, lower)
