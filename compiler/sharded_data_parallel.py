"""zero2, fsdp, hsdp's passes: bucketed all-gathers of sharded parameters, reduce-scatters of their gradients.

Which of them run, and in what order, is ``pass_listing.py``'s to say.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from dpar.compiler.capture import GraphInput, InputKind
from dpar.compiler.costs import spec_of_tensors
from dpar.compiler.lowering import flat_inputs
from dpar.compiler.passes.all_gather import ParameterGroup, bucket_all_gathers_pass
from dpar.compiler.options import DDP_BUCKET_CAP_MB
from dpar.compiler.passes.prefetch import prefetch_all_gathers_pass, prefetch_distance
from dpar.compiler.passes.reduce_scatter import bucket_reduce_scatters_pass
from dpar.compiler.passes.reshard import tag_gathers
from dpar.core.plan import AxisRole, MeshAxis, ParallelPlan
from dpar.core.facts import spec_of, tensor_parallel_spec_of
from dpar.core.torch_internals import FakeScriptObject

log = logging.getLogger("dpar")


def flat_layout(inputs: Sequence[GraphInput], example_inputs: Sequence[Any]) -> list[tuple[int, int]]:
    """For each Dynamo graph input: its position among AOTAutograd's flat forward inputs, and
    the position of its gradient among the backward graph's outputs.

    A DTensor flattens into its local tensor followed by opaque objects (its
    spec), which have no Dynamo counterpart; its gradient takes as many outputs
    when it requires grad, and one (None) when it does not.
    """
    starts = [i for i, value in enumerate(example_inputs) if not isinstance(value, FakeScriptObject)]
    if len(starts) != len(inputs):
        raise RuntimeError(
            f"dpar internal error: {len(inputs)} Dynamo inputs but {len(starts)} flat tensors "
            f"(Dynamo: {[inp.kind.name for inp in inputs]}; flat: {[type(v).__name__ for v in example_inputs]})"
        )
    layout, gradient = [], 0
    for inp, start, end in zip(inputs, starts, [*starts[1:], len(example_inputs)]):
        layout.append((start, gradient))
        gradient += (end - start) if inp.requires_grad else 1
    return layout


def holds_a_block(inp: GraphInput) -> bool:
    """A parameter held as this rank's block of it (split by tensor parallel, or an experts module's experts)."""
    return inp.kind is InputKind.PARAMETER and getattr(tensor_parallel_spec_of(inp.tensor()), "dim", None) is not None


class ShardedGroups:
    """The plan's buckets as the graphs see them (flat input and gradient positions), and the
    passes that gather, reduce-scatter and prefetch them over the shard axis.

    Under zero2/fsdp+ep the experts' blocks are sharded over the shard axis ("dp") and the other
    parameters over every rank (``world``): each bucket splits in two, one per axis."""

    def __init__(self, inputs: Sequence[GraphInput], plan: ParallelPlan, world: MeshAxis) -> None:
        self.inputs, self.plan = list(inputs), plan
        shard, replicate = plan.axis(AxisRole.SHARD), plan.axis(AxisRole.REPLICATE)
        assert shard is not None, "a sharded strategy's plan has a shard axis"
        self.shard = shard
        self.world = world if plan.strategy.expert_parallel else shard
        self.replicate = (replicate.group_name, replicate.size) if replicate is not None else None  # hsdp
        self.groups: list[ParameterGroup] = []
        self.axis_of: dict[str, MeshAxis] = {}  # group name -> the axis it is gathered and reduce-scattered over

    def plan_groups(self, flat_values: Sequence[Any]) -> None:
        """Group the sharded parameters' flat positions by bucket, from the flat forward inputs."""
        layout = flat_layout(self.inputs, flat_values)
        by_bucket: dict[str, list[tuple[int, int]]] = {}
        for inp in self.inputs:
            spec = spec_of(inp.tensor()) if inp.kind is InputKind.PARAMETER else None
            if spec is not None:
                axis = self.shard if holds_a_block(inp) else self.world
                name = self.plan.bucket_of(spec.name) + ("" if axis is self.shard else " (world)")
                self.axis_of[name] = axis
                by_bucket.setdefault(name, []).append(layout[inp.index])
        self.groups = [
            ParameterGroup(name, tuple(i for i, _ in pairs), tuple(g for _, g in pairs))
            for name, pairs in by_bucket.items()
        ]
        log.info("sharded buckets: %s", [(g.name, len(g.inputs)) for g in self.groups])

    def _by_axis(self) -> list[tuple[MeshAxis, list[ParameterGroup]]]:
        axes = dict.fromkeys(self.axis_of[g.name] for g in self.groups)  # the world's first, as the buckets go
        return [(axis, [g for g in self.groups if self.axis_of[g.name] is axis]) for axis in axes]

    def tag_gathers(self, joint: fx.GraphModule) -> fx.GraphModule:
        """Plan the groups from the joint graph's inputs, and tag what the backward gathers again."""
        primals = flat_inputs(joint.graph)
        self.plan_groups([primals[i].meta["val"] for i in sorted(primals)])
        return tag_gathers(joint, self.groups, reshard_after_forward=self.plan.strategy.reshard_after_forward)

    def all_gathers(self, gm: fx.GraphModule) -> fx.GraphModule:
        for axis, groups in self._by_axis():
            gm = bucket_all_gathers_pass(gm, groups, group_name=axis.group_name, world_size=axis.size)
        return gm

    def reduce_scatters(self, gm: fx.GraphModule) -> fx.GraphModule:
        for axis, groups in self._by_axis():
            gm = bucket_reduce_scatters_pass(
                gm, groups, group_name=axis.group_name, world_size=axis.size,
                reduce_dtype=self.plan.reduce_dtype, replicate=self.replicate,
            )
        return gm

    def prefetch(self, gm: fx.GraphModule) -> fx.GraphModule:
        distance = self.plan.max_inflight_gathers
        if distance is None:  # from cost, under ddp's default bucket bound
            spec = spec_of_tensors(i.tensor() for i in self.inputs if i.kind is InputKind.PARAMETER)
            distance = prefetch_distance(gm, spec, self.shard.size, int(DDP_BUCKET_CAP_MB * 2**20))
            log.info("prefetch distance from cost (%s): %d", spec.name, distance)
        return prefetch_all_gathers_pass(gm, distance)
