"""zero2, fsdp, hsdp: bucketed all-gathers of sharded parameters, reduce-scatters of their gradients."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._library.fake_class_registry import FakeScriptObject

from dpar.compiler.capture import GraphInput, InputKind
from dpar.compiler.lowering import GraphRole, Lower, flat_inputs
from dpar.compiler.options import Options
from dpar.compiler.passes.all_gather import ParameterGroup, bucket_all_gathers_pass
from dpar.compiler.data_parallel import broadcast_passes
from dpar.compiler.passes.broadcast_buffers import buffer_broadcast_groups
from dpar.compiler.passes.prefetch import prefetch_all_gathers_pass
from dpar.compiler.passes.reduce_scatter import bucket_reduce_scatters_pass
from dpar.compiler.passes.random_ops import save_random_ops
from dpar.compiler.passes.reshard import tag_gathers
from dpar.compiler.passes.sink_waits import sink_waits_pass
from dpar.compiler.pipeline import Pass, lower_checked, run_passes
from dpar.runtime.sharding import ShardSpec
from dpar.runtime.world import World

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
        raise RuntimeError(f"dpar internal error: {len(inputs)} Dynamo inputs but {len(starts)} flat tensors")
    layout, gradient = [], 0
    for inp, start, end in zip(inputs, starts, [*starts[1:], len(example_inputs)]):
        layout.append((start, gradient))
        gradient += (end - start) if inp.requires_grad else 1
    return layout


class ShardedDataParallelHook:
    """zero2 / fsdp / hsdp: bucketed all-gathers in forward (and backward), reduce-scatters in
    backward, and ddp's broadcast of rank 0's buffers into every forward."""

    def __init__(self, inputs: Sequence[GraphInput], specs: dict[int, ShardSpec], world: World, options: Options) -> None:
        self.inputs = list(inputs)
        self.specs = specs  # Dynamo input index -> how that parameter is sharded
        self.world = world
        self.options = options
        self.groups: list[ParameterGroup] = []
        self.reshard_after_forward = any(s.strategy in ("fsdp", "hsdp") for s in specs.values())
        first = next(iter(specs.values()))
        self.group_name, self.group_size = first.group_name, first.world_size
        self.max_inflight, self.reduce_dtype = first.max_inflight_gathers, first.reduce_dtype
        self.replicate = (first.replicate_group_name, first.replicate_size) if first.replicate_group_name else None
        self.buffer_groups: dict[str, list[int]] = {}  # group -> positions of its buffers among the flat forward inputs

    def joint_passes(self) -> list[Pass]:
        """Run before the forward is compiled: plan the groups from the joint graph's inputs and tag
        what the backward recomputes; activation checkpointing's tags are refined too."""
        return [("tag_gathers", self._tag_gathers), ("save_random_ops", save_random_ops)]

    def _tag_gathers(self, joint: fx.GraphModule) -> fx.GraphModule:
        primals = flat_inputs(joint.graph)
        self._plan_groups([primals[i].meta["val"] for i in sorted(primals)])
        return tag_gathers(joint, self.groups, reshard_after_forward=self.reshard_after_forward)

    def _plan_groups(self, example_inputs: Sequence[Any]) -> None:
        layout = flat_layout(self.inputs, example_inputs)
        # Every rank reads rank 0's buffers, as under ddp; a tensor-parallel block only over the shard group.
        self.buffer_groups = buffer_broadcast_groups(
            [(layout[i.index][0], i.tensor()) for i in self.inputs if i.kind is InputKind.BUFFER],
            whole_group=self.world.group_name, split_group=self.group_name,
        )
        by_bucket: dict[str, list[tuple[int, int]]] = {}
        for index, spec in self.specs.items():
            by_bucket.setdefault(spec.bucket, []).append(layout[index])
        self.groups = [
            ParameterGroup(name, tuple(i for i, _ in pairs), tuple(g for _, g in pairs))
            for name, pairs in by_bucket.items()
        ]
        log.info("sharded buckets: %s", [(g.name, len(g.inputs)) for g in self.groups])

    def _passes(self, role: GraphRole) -> list[Pass]:
        kw = {"group_name": self.group_name, "world_size": self.group_size}
        passes = broadcast_passes(self.options, self.buffer_groups) if role is not GraphRole.BACKWARD else []
        passes.append(("bucket_all_gathers", lambda g: bucket_all_gathers_pass(g, self.groups, **kw)))
        if role is GraphRole.BACKWARD:
            passes.append(
                (
                    "bucket_reduce_scatters",
                    lambda g: bucket_reduce_scatters_pass(
                        g, self.groups, reduce_dtype=self.reduce_dtype, replicate=self.replicate, **kw
                    ),
                )
            )
        if self.options.sink_waits:
            passes.append(("sink_waits", sink_waits_pass))
        # Last: the in-flight bound counts from where the waits finally are.
        passes.append(("prefetch_all_gathers", lambda g: prefetch_all_gathers_pass(g, self.max_inflight)))
        return passes

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower
    ) -> Callable[..., Any]:
        if role is GraphRole.INFERENCE:  # no joint graph was partitioned
            self._plan_groups(example_inputs)
        gm = run_passes(gm, self._passes(role), role.value)
        return lower_checked(gm, example_inputs, f"{role.value} graph", lower, self.world, self.options)
