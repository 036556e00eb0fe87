"""Every pass dpar runs, for every plan, in the order it runs them.

A graph goes through these stages, each a list of named passes run by
``run_passes`` (so each is logged, and kept for ``explain`` and ``dpar inspect``):

  dynamo     the graph Dynamo captured, before AOTAutograd
  joint      forward and backward together, before the partitioner splits them
  forward    the forward AOTAutograd partitioned off; local SGD builds two variants,
             one of which first averages the parameters
  backward   ddp builds one per variant: sync, no_sync (no passes), sync accumulated
  inference  a graph without backward (no_grad): the joint graph's tensor-parallel
             passes, then the forward's
  optimizer  zero1's optimizer step, captured by ``optimizer_step.CapturedStep``:
             after the update, the stepped ranges are gathered into the parameters
             (``optimizer_step.OptimizerStage``, which the backend hands the runtime)

``PassListing`` lists them for one ``ParallelPlan``; the strategy modules
(``data_parallel``, ``sharded_data_parallel``, ``tensor_parallel``) supply the
passes and the state they plan from the graphs (buckets, groups), never the order.
For fsdp+tp, for instance: dynamo [mark_own_rows]; joint [unroll_group_batch,
tensor_parallel, tag_gathers, save_random_ops, keep_collectives_in_forward]; forward [broadcast_buffers,
bucket_all_gathers, sink_waits, prefetch_all_gathers]; backward [recompute_when_needed,
bucket_all_gathers, bucket_reduce_scatters, sink_waits, prefetch_all_gathers].
With an activation policy that recomputes (``ParallelPlan.activations``), the joint stage
ends with [tag_recompute] under every strategy, ddp included (passes/recompute.py), which keeps
the forward's collectives in the forward as keep_collectives_in_forward does for a tensor axis.
``PassListing(...).listing()`` prints that for any plan.

``dpar.pipeline`` runs each stage's graphs as traced (``pipeline_parallel/stage_graphs.py``: F, and B
or its halves I and W); with ``dp > 1`` pipelines side by side on a ``("dp", "pp")`` mesh,
``PipelinePassListing`` lists the data-parallel passes over ``dp`` and builds the variants they run in
(the strategy modules ``pipeline_parallel/data_parallel.py`` and ``pipeline_parallel/sharded.py``
supply the passes). The graph that ends a stage's step is its last B, or its last W under zb_h1 and zbv:

  ddp   B (sync), or W (sync): [all_reduce_gradients, sink_waits]
  fsdp  F (gather), the stage's first F of a step: [gather_parameters];
        B (sync), or W (sync): [reduce_scatter_gradients, sink_waits]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from dpar.compiler.capture import GraphInput, InputKind
from dpar.compiler.collectives import collectives
from dpar.compiler.data_parallel import GradientBuckets, broadcast_buffers
from dpar.compiler.graph_utils import code_written_after, copy_graph_module, fake_like, refresh_fake_values
from dpar.compiler.logs import configure as configure_logs
from dpar.compiler.logs import log_pass
from dpar.compiler.lowering import GraphRole, Lower
from dpar.compiler.options import Options
from dpar.compiler.passes.all_gather_ranges import UpdatedRange, all_gather_updated_ranges
from dpar.compiler.passes.expert_rows import mark_routed_rows
from dpar.compiler.passes.broadcast_buffers import average_inputs_pass, buffer_broadcast_groups
from dpar.compiler.passes.random_ops import save_random_ops
from dpar.compiler.passes.recompute import keep_collectives_in_forward, tag_recompute
from dpar.compiler.passes.recompute_order import recompute_when_needed
from dpar.compiler.passes.gloo_all_gathers import as_run_on_gloo, on_gloo
from dpar.compiler.passes.sink_waits import sink_waits_pass
from dpar.compiler.pipeline_parallel.data_parallel import StageGradientBuckets
from dpar.compiler.pipeline_parallel.schedules import ZERO_BUBBLE
from dpar.compiler.pipeline_parallel.sharded import ShardLayout, gather_parameters, reduce_scatter_gradients, scattered_variant
from dpar.core.plan import AxisRole, DataParallel, MeshAxis, ParallelPlan, Strategy
from dpar.compiler.registry import STAGES_KEY, PassStage, code_wanted, counting_figures, record
from dpar.compiler.sharded_data_parallel import ShardedGroups, flat_layout, holds_a_block
from dpar.compiler.context_parallel import ContextParallel
from dpar.compiler.tensor_parallel import TensorParallel
from dpar.runtime.agreement import agree
from dpar.runtime.gradient_sync import BackwardDispatch, ForwardDispatch, Variant
from dpar.runtime.liveness import Watched, compiling
from dpar.core.facts import period_of
from dpar.core.pipeline_program import StageGraphs, SyncVariant
from dpar.runtime.local_sgd import choose_variant
from dpar.core.world import World, group_ranks

Pass = tuple[str, Callable[[fx.GraphModule], fx.GraphModule]]


def run_passes(gm: fx.GraphModule, passes: Sequence[Pass], label: str) -> fx.GraphModule:
    """Apply ``passes`` in order; the graph after each one is kept in ``gm.meta`` for reports. Its Python code is
    written once, after the last pass (and after each where a report or log reads it)."""
    configure_logs()
    stages = [PassStage.of("captured", gm)]
    each = code_wanted()
    with code_written_after():
        for name, graph_pass in passes:
            gm = graph_pass(gm)
            if each:
                gm.recompile()
            stage = PassStage.of(name, gm)
            log_pass(label, name, dict(stages[-1].op_counts), dict(stage.op_counts), stage.code)
            stages.append(stage)
    if passes and not each:
        gm.recompile()
    gm.meta[STAGES_KEY] = tuple(stages)
    return gm


def optimizer_passes(
    strategy: Strategy, ranges: Sequence[UpdatedRange] = (), example_inputs: Sequence[Any] = (), group: tuple[str, int] = ("", 1)
) -> list[Pass]:
    """An optimizer step graph's passes: zero1's gather of the ranges it stepped (``group``: name, size)."""
    if strategy is not Strategy.ZERO1:
        return []
    name, size = group
    return [("all_gather_updated_ranges",
             lambda g: all_gather_updated_ranges(g, example_inputs, ranges, group_name=name, world_size=size))]


JOINT_LABEL = "joint graph"


@compiling()  # the backward is lowered on its first call, inside the step
def lower_checked(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    label: str,
    lower: Lower,
    world: World,
    options: Options,
    role: GraphRole,
) -> Callable[..., Any]:
    """Record the post-pass graph, agree on its collectives across ranks, then compile it, watched for a
    rank that vanishes (runtime/liveness.py)."""
    refresh_fake_values(gm, example_inputs)
    found = collectives(gm)
    record(label, gm, found)
    if found and world.backend != "fake":  # a fake group simulates ranks that do not exist
        # Sub-groups of a mesh have a different name on each rank: compare their sizes, and a sub-group
        # collective's shape only between the ranks of its group ([Note: what only a sub-group agrees on]).
        members = {c.group: group_ranks(c.group) for c in found}
        lines, within = [], []
        for c in found:
            ranks = members[c.group]
            whole_world = len(ranks) == world.size
            lines.append(c.fingerprint(f"over {len(ranks)} ranks", shape=whole_world))
            within.append(None if whole_world else (f"shape [{', '.join(c.shape)}]", ranks))
        agree(world, label, lines, options.check_timeout_s, within=within)
    if role is GraphRole.BACKWARD and counting_figures():
        return _not_lowered
    compiled = lower(as_run_on_gloo(gm), example_inputs)  # [Note: no all-gather on gloo]
    return compiled if world.backend == "fake" else Watched(compiled, role.value)


def _not_lowered(*args: Any) -> None:
    raise RuntimeError("dpar: a backward compiled under figures_only() is counted, not lowered; run the step outside it")


class PassListing:
    """One plan's passes, stage by stage, and the hook ``compile_graphs`` calls with every graph."""

    def __init__(self, plan: ParallelPlan, inputs: Sequence[GraphInput], world: World, options: Options) -> None:
        self.plan, self.inputs, self.world, self.options = plan, list(inputs), world, options
        self.tensor = TensorParallel(inputs, plan) if plan.strategy.tensor_parallel else None
        self.context = ContextParallel(inputs, plan) if plan.strategy.context_parallel else None
        self.sharded = ShardedGroups(inputs, plan, self._world_axis()) if plan.strategy.shards_parameters else None
        replicate = plan.axis(AxisRole.REPLICATE)
        self.gradients = (
            GradientBuckets(self._replicated(inputs), options.bucket_cap_bytes, from_cost=options.bucket_cap_mb is None)
            if plan.strategy.all_reduces_gradients else None
        )
        self.replicate = replicate
        self.period = next(  # local SGD: where the model is in its period (parallelize attached it)
            (period_of(i.tensor()) for i in inputs if i.kind is InputKind.PARAMETER), None
        ) if plan.strategy is Strategy.LOCAL_SGD else None
        # The forward a strategy runs instead on some calls: local SGD's, every H steps.
        self.other_forward: tuple[str, Pass] | None = (
            ("average", ("average_parameters", self._average_parameters)) if plan.strategy is Strategy.LOCAL_SGD else None
        )
        self.buffer_groups: dict[str, list[int]] = {}  # group -> positions of its buffers among the flat inputs

    def _replicated(self, inputs: Sequence[GraphInput]) -> list[tuple[list[GraphInput], MeshAxis]]:
        """The inputs whose gradients ddp's buckets all-reduce, grouped by the axis they average over. Under ep
        the experts' blocks are whole on their rank over the ep axis (see [Note: routed tokens in fixed-size
        buffers]): they average over "dp" only (ddp+ep; ep alone: nowhere), the rest over every rank."""
        replicate = self.plan.axis(AxisRole.REPLICATE)
        if not self.plan.strategy.expert_parallel:
            return [(list(inputs), replicate)]
        groups = [([i for i in inputs if not holds_a_block(i)], self._world_axis())]
        if replicate is not None:
            groups.append(([i for i in inputs if holds_a_block(i)], replicate))
        return groups

    def _world_axis(self) -> MeshAxis:
        """Every rank, as one data axis: under ep the parameters outside the experts are data parallel over it (a
        listing without a process group, for docs: the plan's ranks)."""
        if self.world is None:
            return MeshAxis("world", AxisRole.REPLICATE, math.prod(self.plan.mesh_shape), "")
        return MeshAxis("world", AxisRole.REPLICATE, self.world.size, self.world.group_name)

    # The stages, in the order a graph meets them.

    def dynamo_passes(self) -> list[Pass]:
        if self.context is not None:
            return [("mark_sequences", self.context.mark_inputs)]
        if self.tensor is not None and self.tensor.group_batch is not None:
            return [("mark_own_rows", self.tensor.mark_own_rows)]
        return []

    def joint_passes(self) -> list[Pass]:
        passes = self._tensor_parallel_passes()
        expert = self.plan.axis(AxisRole.EXPERT)
        if expert is not None:
            passes.append(("mark_routed_rows",
                           lambda g: mark_routed_rows(g, group_name=expert.group_name, ep_size=expert.size)))
        if self.sharded is not None:
            passes += [("tag_gathers", self.sharded.tag_gathers), ("save_random_ops", save_random_ops)]
        if self.plan.activations.recomputes:  # last: it keeps the tags the strategy's passes chose
            passes.append(("tag_recompute", lambda g: tag_recompute(g, self.plan.activations)))
        elif self.tensor is not None or self.context is not None:  # after tag_gathers: fsdp's re-gathers stay the backward's
            passes.append(("keep_collectives_in_forward", keep_collectives_in_forward))
        return passes

    def _tensor_parallel_passes(self) -> list[Pass]:
        """The joint graph's passes of an axis activations cross (tensor or context), which no-grad graphs run too."""
        if self.context is not None:  # with a tensor axis: its split first, then the sequence's over its blocks
            unroll = [("unroll_group_batch", self.context.unroll_group_batch)] if self.context.group_batch is not None else []
            tensor = [("tensor_parallel", self.tensor.tensor_parallel)] if self.tensor is not None else []
            return [*unroll, *tensor, ("context_parallel", self.context.context_parallel)]
        if self.tensor is None:
            return []
        unroll = [("unroll_group_batch", self.tensor.unroll_group_batch)] if self.tensor.group_batch is not None else []
        return [*unroll, ("tensor_parallel", self.tensor.tensor_parallel)]

    def forward_passes(self, other: bool = False) -> list[Pass]:
        passes: list[Pass] = []
        if other and self.other_forward is not None:
            passes.append(self.other_forward[1])
        if self.options.broadcast_buffers:
            passes.append(("broadcast_buffers", lambda g: broadcast_buffers(g, self.buffer_groups)))
        if self.sharded is not None:
            passes.append(("bucket_all_gathers", self.sharded.all_gathers))
        return self._then_waits(passes)

    def backward_passes(self, variant: Variant = Variant.SYNC) -> list[Pass]:
        passes: list[Pass] = []
        if any(axis is not None and axis.group_batch is not None for axis in (self.tensor, self.context)):
            passes.append(("recompute_when_needed", recompute_when_needed))  # [Note: recomputation where it is needed]
        # cp's gradient sums, every step (no_sync too): after zero2's / fsdp's reduce-scatters, which sharding
        # runs first (the sums are of shards), before ddp's all-reduce, which the graph adds after them.
        if self.sharded is not None:
            passes += [("bucket_all_gathers", self.sharded.all_gathers), ("bucket_reduce_scatters", self.sharded.reduce_scatters)]
        if self.context is not None:
            passes.append(("bucket_cp_gradients", self.context.bucket_gradients))
        if self.sharded is None and self.gradients is not None:
            if variant is Variant.NO_SYNC:  # gradients accumulate locally: nothing more to insert
                return self._then_waits(passes) if passes else []
            passes.append(("all_reduce_gradients", lambda g: self.gradients.all_reduce(g, variant)))
        return self._then_waits(passes)

    def inference_passes(self) -> list[Pass]:
        return self._tensor_parallel_passes() + self.forward_passes()

    def _then_waits(self, passes: list[Pass]) -> list[Pass]:
        if self.options.sink_waits:
            passes.append(("sink_waits", sink_waits_pass))
        if self.sharded is not None:  # last: the in-flight bound counts from where the waits finally are
            passes.append(("prefetch_all_gathers", self.sharded.prefetch))
        return passes

    def listing(self) -> dict[str, list[str]]:
        """Stage -> the names of its passes, in order."""
        stages = {
            "dynamo": self.dynamo_passes(), "joint": self.joint_passes(), "forward": self.forward_passes(),
            **({f"forward ({self.other_forward[0]})": self.forward_passes(other=True)} if self.other_forward else {}),
            **{f"backward ({v.value})": self.backward_passes(v) for v in Variant}, "inference": self.inference_passes(),
            "optimizer": optimizer_passes(self.plan.strategy),
        }
        return {stage: [name for name, _ in passes] for stage, passes in stages.items()}

    # Running them.

    def prepare(self, gm: fx.GraphModule) -> fx.GraphModule:
        """The Dynamo graph, before AOTAutograd sees it."""
        return run_passes(gm, self.dynamo_passes(), "dynamo")

    def joint(self) -> Callable[[fx.GraphModule], fx.GraphModule] | None:
        """The joint graph's passes as one function for the partitioner (None: AOTAutograd's default
        partitioner). The result is recorded under ``JOINT_LABEL``; its collectives are the forward's
        and backward's again, which reports skip."""
        passes = self.joint_passes()
        if not passes:
            return None

        def run(joint: fx.GraphModule) -> fx.GraphModule:
            joint = run_passes(joint, passes, JOINT_LABEL)
            record(JOINT_LABEL, joint, collectives(joint))
            return joint

        return run

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower) -> Callable[..., Any]:
        if role is GraphRole.BACKWARD:
            if self.gradients is not None:
                return self._backward_variants(gm, example_inputs, lower)
            passes = self.backward_passes()
        else:
            self._plan_buffers(example_inputs)
            if role is GraphRole.INFERENCE and self.sharded is not None:  # no joint graph planned the groups
                self.sharded.plan_groups(example_inputs)
            if role is GraphRole.FORWARD and self.other_forward is not None:
                return self._forward_variants(gm, example_inputs, lower)
            passes = self.forward_passes() if role is GraphRole.FORWARD else self.inference_passes()
        gm = run_passes(gm, passes, role.value)
        return lower_checked(gm, example_inputs, f"{role.value} graph", lower, self.world, self.options, role)

    def _plan_buffers(self, flat_values: Sequence[Any]) -> None:
        """Every rank reads rank 0's buffers, as under ddp; a tensor-parallel block only over its data axis."""
        layout = flat_layout(self.inputs, flat_values)
        data_axis = self.plan.data_axes[0].group_name if self.plan.strategy.tensor_parallel and self.plan.data_axes else None
        self.buffer_groups = buffer_broadcast_groups(
            [(layout[i.index][0], i.tensor()) for i in self.inputs if i.kind is InputKind.BUFFER],
            whole_group=self.world.group_name, split_group=data_axis,
        )

    def _trained(self) -> list[GraphInput]:
        return [i for i in self.inputs if i.kind is InputKind.PARAMETER and i.requires_grad]

    def _average_parameters(self, gm: fx.GraphModule) -> fx.GraphModule:
        assert self.replicate is not None and self.period is not None
        outer = self.period.outer
        outer = (outer.lr, outer.momentum, outer.nesterov) if outer is not None else None
        return average_inputs_pass(
            gm, [i.index for i in self._trained()], group_name=self.replicate.group_name,
            world_size=self.replicate.size, outer=outer,
        )

    def _forward_variants(self, gm: fx.GraphModule, example_inputs: Sequence[Any], lower: Lower) -> Callable[..., Any]:
        """The forward compiled with and without ``other_forward``'s pass, chosen each call by the runtime."""
        assert self.other_forward is not None
        name = self.other_forward[0]
        trained = self._trained()
        outer = self.period is not None and self.period.outer is not None

        def build(other: bool) -> Callable[..., Any]:
            label = f"forward graph ({name})" if other else "forward graph"
            graph = run_passes(copy_graph_module(gm), self.forward_passes(other), label)
            inputs = list(example_inputs)
            if other and outer:  # DiLoCo's anchors and momenta, as the dispatch appends them
                inputs += [fake_like(example_inputs[i.index]) for i in trained] * 2
            return lower_checked(graph, inputs, label, lower, self.world, self.options, GraphRole.FORWARD)

        assert self.period is not None, "parallelize attached a period to a local-SGD model's parameters"
        parameters = [i.tensor for i in self.inputs if i.kind is InputKind.PARAMETER]
        dispatch = ForwardDispatch(choose_variant(self.period, parameters, [i.tensor for i in trained]), build)
        dispatch.prepare(False)
        return dispatch

    def _backward_variants(self, gm: fx.GraphModule, example_inputs: Sequence[Any], lower: Lower) -> Callable[..., Any]:
        """ddp: the backward compiled per variant on first use, chosen each step by ``no_sync``."""
        assert self.gradients is not None
        self.gradients.plan(gm)
        order = self.gradients.accumulation_order
        outputs = gm.graph.output_node().args[0]

        def build(variant: Variant) -> Callable[..., Any]:
            label = f"backward graph ({variant.value})"
            graph = run_passes(copy_graph_module(gm), self.backward_passes(variant), label)
            inputs = list(example_inputs)
            if variant is Variant.SYNC_ACCUMULATED:
                inputs += [fake_like(outputs[i].meta["val"]) for i in order]
            return lower_checked(graph, inputs, label, lower, self.world, self.options, GraphRole.BACKWARD)

        dispatch = BackwardDispatch(self.gradients.parameters(), order, build)
        dispatch.prepare(Variant.SYNC)
        return dispatch


class PipelinePassListing:
    """``dpar.pipeline``'s data-parallel passes over ``dp``, graph by graph of a stage (see the module docstring).

    ``mode``: ``DataParallel.DDP`` ([Note: data parallel across pipelines]) or ``DataParallel.FSDP`` ([Note: sharded
    data parallel across pipelines]); with ``dp_size`` 1 there is nothing to average and no variant.
    """

    GRAPHS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
    """A stage's graphs, by the letter schedules name their actions with."""

    def __init__(self, mode: DataParallel, dp_size: int, schedule: str, *, group_name: str = "",
                 bucket_cap_mb: float = 25) -> None:
        self.mode = mode if dp_size > 1 else None
        self.dp_size, self.group_name, self.bucket_cap_mb = dp_size, group_name, bucket_cap_mb
        self.last = "backward_weight" if schedule in ZERO_BUBBLE else "backward"  # the graph that ends a stage's step

    def gather_passes(self, graphs: StageGraphs | None = None, layout: ShardLayout | None = None) -> list[Pass]:
        """The stage's first forward of a step (fsdp only)."""
        if self.mode is not DataParallel.FSDP:
            return []
        passes: list[Pass] = [("gather_parameters", lambda g: gather_parameters(g, graphs, layout, self.group_name))]
        if self.group_name and on_gloo(self.group_name):  # [Note: no all-gather on gloo]
            passes.append(("all_gathers_as_all_reduces", as_run_on_gloo))
        return passes

    def sync_passes(
        self, graphs: StageGraphs | None = None, planned: StageGradientBuckets | ShardLayout | None = None
    ) -> list[Pass]:
        """The graph that ends the stage's step (``planned``: ddp's buckets, fsdp's layout)."""
        if self.mode is DataParallel.DDP:
            passes = [("all_reduce_gradients", lambda g: planned.all_reduce(g))]
        elif self.mode is DataParallel.FSDP:
            passes = [("reduce_scatter_gradients",
                       lambda g: reduce_scatter_gradients(g, graphs, self.last, planned, self.group_name))]
        else:
            return []
        return [*passes, ("sink_waits", sink_waits_pass)]

    def listing(self) -> dict[str, list[str]]:
        """Graph -> the names of its passes, in order: the stage's graphs (none), then the variants built."""
        rows: dict[str, list[str]] = {letter: [] for letter in self.GRAPHS}
        if self.mode is DataParallel.FSDP:
            rows["F (gather)"] = [name for name, _ in self.gather_passes()]
        if self.mode is not None:
            last = next(letter for letter, kind in self.GRAPHS.items() if kind == self.last)
            rows[f"{last} (sync)"] = [name for name, _ in self.sync_passes()]
        return rows

    # Running them: each variant on its own copy of the stage's graph.

    def gather_variant(self, graphs: StageGraphs, layout: ShardLayout) -> fx.GraphModule:
        return run_passes(copy_graph_module(graphs.forward), self.gather_passes(graphs, layout),
                          f"pipeline stage {graphs.stage.index} forward (gather over dp)")

    def sync_variant(self, graphs: StageGraphs, layout: ShardLayout | None = None) -> SyncVariant:
        """ddp: the gradients all-reduced in buckets; fsdp (``layout``): reduce-scattered into this rank's shards."""
        gm = copy_graph_module(getattr(graphs, self.last))
        if self.mode is DataParallel.DDP:
            buckets = StageGradientBuckets(gm, graphs, self.last, group_name=self.group_name, dp_size=self.dp_size,
                                           cap_bytes=int(self.bucket_cap_mb * 2**20))
            gm = run_passes(gm, self.sync_passes(graphs, buckets),
                            f"pipeline stage {graphs.stage.index} {self.last} (sync over dp)")
            return buckets.variant(gm)
        assert self.mode is DataParallel.FSDP and layout is not None
        gm = run_passes(gm, self.sync_passes(graphs, layout),
                        f"pipeline stage {graphs.stage.index} {self.last} (reduce-scatter over dp)")
        return scattered_variant(gm, layout)
