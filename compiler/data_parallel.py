"""ddp: replicate parameters, one averaged all-reduce per gradient bucket in the backward."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from dpar.compiler.capture import GraphInput, InputKind
from dpar.compiler.graph_utils import copy_graph_module, fake_like
from dpar.compiler.lowering import GraphRole, Lower
from dpar.compiler.options import Options
from dpar.compiler.passes.all_reduce import accumulated_gradient_order, all_reduce_gradients_pass
from dpar.compiler.passes.broadcast_buffers import broadcast_buffers_pass, buffer_broadcast_groups
from dpar.compiler.passes.buckets import Bucket, Gradient, plan_buckets
from dpar.compiler.passes.sink_waits import sink_waits_pass
from dpar.compiler.pipeline import Pass, lower_checked, run_passes
from dpar.runtime.gradient_sync import BackwardDispatch, Variant
from dpar.runtime.world import World

log = logging.getLogger("dpar")


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


def broadcast_passes(options: Options, groups: dict[str, list[int]]) -> list[Pass]:
    """DDP's broadcast_buffers, one pass per group of ``buffer_broadcast_groups``."""
    if not options.broadcast_buffers:
        return []
    return [
        ("broadcast_buffers" if len(groups) == 1 else f"broadcast_buffers[{group}]",
         lambda g, group=group, positions=positions: broadcast_buffers_pass(g, positions, group_name=group))
        for group, positions in groups.items()
    ]


def ddp_forward_passes(
    inputs: Sequence[GraphInput], world: World, options: Options, whole_group: str | None = None
) -> list[Pass]:
    """``whole_group`` (ddp+tp: the whole world's) is where unsplit buffers are broadcast; ``world`` is data parallel's."""
    buffers = [(i.index, i.tensor()) for i in inputs if i.kind is InputKind.BUFFER]
    groups = buffer_broadcast_groups(buffers, whole_group=whole_group or world.group_name, split_group=world.group_name)
    passes = broadcast_passes(options, groups)
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


class DataParallelHook:
    """Turns each graph AOTAutograd produces into its data-parallel version."""

    def __init__(
        self, inputs: Sequence[GraphInput], world: World, options: Options, whole_group: str | None = None
    ) -> None:
        self.inputs = list(inputs)
        self.world = world
        self.options = options
        self.whole_group = whole_group  # ddp+tp: the whole world's group, where unsplit buffers are broadcast
        self.buckets: list[Bucket] = []

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower
    ) -> Callable[..., Any]:
        if role is not GraphRole.BACKWARD:
            gm = run_passes(gm, ddp_forward_passes(self.inputs, self.world, self.options, self.whole_group), role.value)
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
