"""The ordered passes of each strategy, and the hook that runs them on every captured graph."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._library.fake_class_registry import FakeScriptObject

from dpar.compiler.capture import GraphInput, InputKind
from dpar.compiler.collectives import collectives
from dpar.compiler.graph_utils import copy_graph_module, fake_like, refresh_fake_values
from dpar.compiler.lowering import GraphRole, Lower
from dpar.compiler.options import Options
from dpar.compiler.inspect.logs import configure as configure_logs, log_pass
from dpar.compiler.registry import STAGES_KEY, PassStage, record
from dpar.compiler.passes.all_gather import ParameterGroup, bucket_all_gathers_pass
from dpar.compiler.passes.prefetch import prefetch_all_gathers_pass
from dpar.compiler.passes.reduce_scatter import bucket_reduce_scatters_pass
from dpar.compiler.passes.reshard import tag_gathers_for_recompute
from dpar.runtime.sharding import ShardSpec
from dpar.compiler.passes.all_reduce import accumulated_gradient_order, all_reduce_gradients_pass
from dpar.compiler.passes.broadcast_buffers import broadcast_buffers_pass
from dpar.compiler.passes.buckets import Bucket, Gradient, plan_buckets
from dpar.compiler.passes.sink_waits import sink_waits_pass
from dpar.runtime.agreement import agree
from dpar.runtime.gradient_sync import BackwardDispatch, Variant
from dpar.runtime.world import World, group_size

log = logging.getLogger("dpar")

Pass = tuple[str, Callable[[fx.GraphModule], fx.GraphModule]]


def gradients_of(gm: fx.GraphModule, inputs: Sequence[GraphInput]) -> list[Gradient]:
    """The parameter gradients a backward graph returns, with where each becomes ready."""
    outputs = gm.graph.output_node().args[0]
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [
        Gradient(
            output_index=inp.index,
            name=inp.name,
            shape=inp.shape,
            dtype=inp.dtype,
            ready_at=position[outputs[inp.index]],
        )
        for inp in inputs
        if inp.kind is InputKind.PARAMETER and isinstance(outputs[inp.index], fx.Node)
    ]


def ddp_forward_passes(inputs: Sequence[GraphInput], world: World, options: Options) -> list[Pass]:
    buffers = [i.index for i in inputs if i.kind is InputKind.BUFFER]
    passes: list[Pass] = []
    if options.broadcast_buffers and buffers:
        passes.append(
            ("broadcast_buffers", lambda g: broadcast_buffers_pass(g, buffers, group_name=world.group_name))
        )
    if options.sink_waits:
        passes.append(("sink_waits", sink_waits_pass))
    return passes


def ddp_backward_passes(
    buckets: Sequence[Bucket], variant: Variant, world: World, options: Options
) -> list[Pass]:
    if variant is Variant.NO_SYNC:
        return []
    passes: list[Pass] = [
        (
            "all_reduce_gradients",
            lambda g: all_reduce_gradients_pass(
                g,
                buckets,
                group_name=world.group_name,
                world_size=world.size,
                accumulate=variant is Variant.SYNC_ACCUMULATED,
            ),
        )
    ]
    if options.sink_waits:
        passes.append(("sink_waits", sink_waits_pass))
    return passes


def run_passes(gm: fx.GraphModule, passes: Sequence[Pass], label: str) -> fx.GraphModule:
    """Apply ``passes`` in order; the graph after each one is kept in ``gm.meta`` for reports."""
    configure_logs()
    stages = [PassStage.of("captured", gm)]
    for name, graph_pass in passes:
        gm = graph_pass(gm)
        stage = PassStage.of(name, gm)
        log_pass(label, name, dict(stages[-1].op_counts), dict(stage.op_counts), stage.code)
        stages.append(stage)
    gm.meta[STAGES_KEY] = tuple(stages)
    return gm


def lower_checked(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    label: str,
    lower: Lower,
    world: World,
    options: Options,
) -> Callable[..., Any]:
    """Record the post-pass graph, agree on its collectives across ranks, then compile it."""
    refresh_fake_values(gm, example_inputs)
    found = collectives(gm)
    record(label, gm, found)
    if found and world.backend != "fake":  # a fake group simulates ranks that do not exist
        # Sub-groups of a mesh have a different name on each rank: compare their sizes.
        sizes = {c.group: group_size(c.group) for c in found}
        lines = [c.fingerprint(f"over {sizes[c.group]} ranks") for c in found]
        agree(world, label, lines, options.check_timeout_s)
    return lower(gm, example_inputs)


class DataParallelHook:
    """Turns each graph AOTAutograd produces into its data-parallel version."""

    def __init__(self, inputs: Sequence[GraphInput], world: World, options: Options) -> None:
        self.inputs = list(inputs)
        self.world = world
        self.options = options
        self.buckets: list[Bucket] = []

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower
    ) -> Callable[..., Any]:
        if role is not GraphRole.BACKWARD:
            gm = run_passes(gm, ddp_forward_passes(self.inputs, self.world, self.options), role.value)
            return lower_checked(gm, example_inputs, f"{role.value} graph", lower, self.world, self.options)

        self.buckets = plan_buckets(gradients_of(gm, self.inputs), self.options.bucket_cap_bytes)
        log.info(
            "buckets: %s",
            [(b.index, str(b.dtype), b.nbytes, [g.name for g in b.gradients]) for b in self.buckets],
        )
        order = accumulated_gradient_order(self.buckets)
        outputs = gm.graph.output_node().args[0]

        def build(variant: Variant) -> Callable[..., Any]:
            label = f"backward graph ({variant.value})"
            graph = run_passes(
                copy_graph_module(gm),
                ddp_backward_passes(self.buckets, variant, self.world, self.options),
                label,
            )
            inputs = list(example_inputs)
            if variant is Variant.SYNC_ACCUMULATED:
                inputs += [fake_like(outputs[i].meta["val"]) for i in order]
            return lower_checked(graph, inputs, label, lower, self.world, self.options)

        parameters = {i.index: i.tensor for i in self.inputs if i.kind is InputKind.PARAMETER}
        dispatch = BackwardDispatch(parameters, order, build)
        dispatch.prepare(Variant.SYNC)
        return dispatch


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
    """zero2 / fsdp: bucketed all-gathers in forward (and backward), reduce-scatters in backward."""

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

    def tag_joint(self, joint: fx.GraphModule) -> fx.GraphModule:
        """Runs before the forward is compiled: plan the groups from the joint graph's inputs."""
        primals = [n.meta["val"] for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals_")]
        self._plan_groups(primals)
        if self.reshard_after_forward:
            tag_gathers_for_recompute(joint, self.groups)
        return joint

    def _plan_groups(self, example_inputs: Sequence[Any]) -> None:
        layout = flat_layout(self.inputs, example_inputs)
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
        passes: list[Pass] = [("bucket_all_gathers", lambda g: bucket_all_gathers_pass(g, self.groups, **kw))]
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
