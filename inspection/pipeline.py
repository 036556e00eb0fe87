"""``dpar.explain(..., strategy="pipeline")``: the stage split, the schedule and its simulated timeline.

Everything comes from one process and no process group: the model and loss are captured at one
micro-batch's shape, cut into stages, each stage priced (``compiler/pipeline_parallel/costs.py``), the named schedule
built for the pipeline's ranks and replayed with those costs (``simulate``). The ranks of one
pipeline are simulated; at ``world_size = pp x dp`` the ``dp`` pipelines run the same and then
all-reduce each stage's gradients.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from dpar.compiler.pipeline_parallel.schedules import bubble_formula, build_schedule, stages_per_rank
from dpar.compiler.pipeline_parallel.simulate import SimulatedTimeline, simulate
from dpar.core.pipeline_program import Op, PipelineSchedule, StageSplit
from dpar.compiler.costs import DeviceSpec, comm_time, device_spec
from dpar.compiler.kernel_profile import timing_device
from dpar.compiler.memory import OPTIMIZER_STATES
from dpar.compiler.pipeline_parallel.costs import (
    BlockCollectives, Collectives, LossFn, StageCost, TensorParallelCost, action_cost, hop_latency, micro_batch_of,
    price_stages, graph_collectives, tensor_parallel_cost, with_loss,
)
from dpar.inspect.report import Table, _mib, _time
from dpar.inspect.trace import write_schedule_trace
from dpar.core.errors import OptionsError
from dpar.core.plan import KEEP_ACTIVATIONS, ActivationPolicy
from dpar.inspect.fake_world import fake_world

if TYPE_CHECKING:
    from rich.console import Console

PipelineBuilder = Callable[..., Any]
"""``dpar.pipeline``, handed down by the api (see ``explain_pipeline``)."""

ACTIONS_SHOWN = 10
"""A rank's program longer than twice this is printed as its first and last ``ACTIONS_SHOWN`` actions."""


@dataclasses.dataclass(frozen=True)
class PipelineReport:
    model: str
    world_size: int
    data_parallel: int  # pipelines side by side; world_size = ranks per pipeline x tp x data_parallel
    device: str
    optimizer: str
    micro_batch_rows: int
    split: StageSplit
    stages: tuple[StageCost, ...]
    schedule: PipelineSchedule
    timeline: SimulatedTimeline
    dp_all_reduce_s: tuple[float, ...]  # per rank: its stages' gradients over the data-parallel ranks
    tp: TensorParallelCost  # each stage split over tp ranks (degree 1: none)
    activations: ActivationPolicy = KEEP_ACTIVATIONS  # what each stage's blocks recompute in the backward

    @property
    def ranks(self) -> int:
        return self.schedule.num_ranks

    @property
    def bubble_formula(self) -> float:
        """The schedule's bubble with equal-cost actions (``schedules.bubble_formula``)."""
        v = self.schedule.num_stages // self.schedule.num_ranks
        return bubble_formula(self.schedule.name, self.ranks, self.schedule.micro_batches, v)

    @property
    def step_time(self) -> float:
        """The simulated span, then the slowest rank's gradient all-reduce (not overlapped: an upper bound)."""
        return self.timeline.span + max(self.dp_all_reduce_s)

    def held_activation_bytes(self, stage: int) -> int:
        """Activations stage ``stage`` holds at its peak on one of its ranks: its in-flight micro-batches'
        saved values (/ tp: sequence parallel splits every one)."""
        return self.timeline.peak_in_flight[stage] * self.stages[stage].activation_bytes // self.tp.degree

    def rank_memory(self, rank: int) -> int:
        """Parameters, gradients, optimizer state and peak activations of the rank's stages (summed over
        its stages: an upper bound where a rank holds several), / tp (its block of each)."""
        return sum(self.stages[s].state_bytes(self.optimizer) // self.tp.degree + self.held_activation_bytes(s)
                   for s in self.schedule.stages_of(rank))

    @property
    def title(self) -> str:
        v = self.schedule.num_stages // self.ranks
        layout = f"{self.ranks} ranks" + (" x 2 stages in a V" if self.schedule.name == "zbv" else
                                          f" x {v} virtual stages" if v > 1 else "")
        dp = f", {self.data_parallel} pipelines (dp)" if self.data_parallel > 1 else ""
        dp += f", each stage over {self.tp.degree} tp ranks" if self.tp.degree > 1 else ""
        return (f"dpar pipeline report: {self.model}, {self.schedule.name} on {layout}{dp}, "
                f"{self.schedule.micro_batches} micro-batches of {self.micro_batch_rows} rows ({self.device})")

    def stage_table(self) -> Table:
        """Whole stages; under tp each rank holds and computes 1/tp of them and runs the tp collectives."""
        tp = self.tp
        title = f"Stages (per micro-batch of {self.micro_batch_rows} rows)"
        if tp.degree > 1:
            title += f"; each split over {tp.degree} tp ranks, its tp collectives read off its graphs"
        if self.activations.recomputes:
            title += f"; activations {self.activations}, recomputed in B (I + W)"
        used = {a.op for actions in self.schedule.actions for a in actions}
        ops = [op for op in Op if op.is_compute and op in used]  # F, B, I, W: the enum's order
        return Table(
            title,
            ("stage", "rank", "blocks", "parameters", "parameter bytes", "forward FLOPs", "forward time",
             "recomputed", "saved activations", "sends to next", "tp collectives per action (one tp rank)"),
            tuple(
                (str(c.index), str(self.schedule.stage_rank(c.index)), _blocks(c.blocks), f"{c.parameter_numel:,}",
                 f"{c.parameter_bytes:,}", f"{c.flops / 1e6:,.2f} M", _time(c.forward_s),
                 f"{_time(c.recompute_s)} ({_time(c.recompute_input_s)} in I)" if c.recompute_s else "-",
                 f"{c.activation_bytes:,}",
                 f"{c.send_bytes:,} B in {_time(c.send_s)}" if c.send_bytes else "-",
                 _tp_cell(tp, c.index, ops) if tp.degree > 1 else "-")
                for c in self.stages
            ),
        )

    def schedule_table(self) -> Table:
        rows = []
        for rank, actions in enumerate(self.schedule.actions):
            names = [str(a) for a in actions]
            if len(names) > 2 * ACTIONS_SHOWN:
                cut = len(names) - 2 * ACTIONS_SHOWN
                names = [*names[:ACTIONS_SHOWN], f"... {cut} more ...", *names[-ACTIONS_SHOWN:]]
            rows.append((str(rank), str(len(actions)), " ".join(names)))
        return Table(
            f"Schedule {self.schedule.name} (F forward, B backward, I/W its input/weight halves, "
            "SA/RA send/receive activation, SG/RG gradient; stage.micro-batch)",
            ("rank", "actions", "program"), tuple(rows),
        )

    def timeline_table(self) -> Table:
        t = self.timeline
        return Table(
            f"Simulated step ({self.device}): span {_time(t.span)}, bubble formula {self.bubble_formula:.1%}",
            ("rank", "busy", "bubble (simulated)", "bubble (formula)", "peak in-flight micro-batches",
             "activations held", "params+grads+optimizer", "memory", "dp all-reduce"),
            tuple(
                (str(r), _time(t.busy[r]), f"{t.bubble[r]:.1%}", f"{self.bubble_formula:.1%}",
                 str(t.peak_in_flight_of_rank(r)),
                 _mib(sum(self.held_activation_bytes(s) for s in self.schedule.stages_of(r))),
                 _mib(sum(self.stages[s].state_bytes(self.optimizer) for s in self.schedule.stages_of(r))
                      // self.tp.degree),
                 _mib(self.rank_memory(r)), _time(self.dp_all_reduce_s[r]))
                for r in range(self.ranks)
            ),
        )

    def tables(self) -> list[Table]:
        return [self.stage_table(), self.schedule_table(), self.timeline_table()]

    def summary(self) -> str:
        hop = hop_latency(self.stages)
        tp = (f"; each compute action / {self.tp.degree} plus the tp collectives its graph holds"
              if self.tp.degree > 1 else "")
        return (f"step time {_time(self.step_time)} = span {_time(self.timeline.span)} + dp all-reduce "
                f"{_time(max(self.dp_all_reduce_s))}; backward = 2 x forward (zb_h1, zbv: I = W = forward), "
                f"each send {_time(hop)} (alpha-beta, largest boundary){tp}")

    def save(self, path: str | Path) -> Path:
        """The simulated schedule as Perfetto JSON (a process per rank, compute and send/recv threads)."""
        return write_schedule_trace(self.timeline, path)


def _tp_cell(tp: TensorParallelCost, stage: int, ops: Sequence[Op]) -> str:
    """``F 4 all_reduce 0.009 ms; B 12 all_reduce 0.027 ms``: each action's collectives, by kind, and their time."""
    parts = []
    for op in ops:
        kinds = collections.Counter(kind for kind, _ in tp.collectives[stage].get(op, ()))
        listed = ", ".join(f"{n} {kind}" for kind, n in kinds.items()) or "none"
        parts.append(f"{op.value} {listed} {_time(tp.seconds[stage].get(op, 0.0))}")
    return "; ".join(parts)


def _blocks(blocks: Sequence[str]) -> str:
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})"


def explain_pipeline(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    stages: int,
    micro_batches: int,
    schedule: str = "1f1b",
    world_size: int | None = None,
    virtual_stages: int | None = None,
    loss_fn: LossFn | None = None,
    split_points: Sequence[str] | None = None,
    device: str | DeviceSpec = "h100",
    optimizer: str = "adamw",
    tensor_parallel: int = 1,
    pipeline: PipelineBuilder | None = None,
    activations: ActivationPolicy = KEEP_ACTIVATIONS,
    profile_kernels: bool = False,
) -> PipelineReport:
    """Report on ``model`` cut into ``stages`` pipeline stages, without running it.

    ``example_inputs`` is one rank's slice as ``dpar.pipeline`` takes it: the pipeline's batch is
    that many rows times its ranks, cut into ``micro_batches``. With ``loss_fn`` the last input is
    the target; without, the model's output is taken as logits and priced with cross-entropy
    against targets shaped like the first input. ``virtual_stages`` (interleaved_1f1b, default 2)
    puts that many stages on each rank. ``world_size`` (default: the pipeline's ranks) adds
    ``world_size / ranks`` data-parallel pipelines, whose gradient all-reduce the step includes.
    ``tensor_parallel`` splits each stage over that many ranks (``dpar.pipeline`` over a ``("dp", "pp", "tp")``
    mesh; ``world_size`` then counts them too): ``pipeline`` (``dpar.pipeline``, which ``dpar.explain`` and ``dpar
    inspect`` hand down: inspection does not import the api) builds each stage's graphs on a copy under a fake
    world, and the tp collectives the pass put in them are counted and priced on the tp link. ``activations``: the
    blocks' policy, priced as ``dpar.pipeline(activation_checkpointing=...)`` runs it ([Note: the pipeline cost
    model]). ``profile_kernels``: each stage's kernels timed on this machine, as ``dpar.explain`` takes it.
    """
    v = stages_per_rank(schedule, virtual_stages)
    if not isinstance(stages, int) or stages < 1 or stages % v:
        raise OptionsError(f"pipeline inspection: stages={stages} is not a positive multiple of virtual_stages={v}; "
                           "use a multiple of it (each rank holds virtual_stages stages)")
    ranks = stages // v
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise OptionsError(f"pipeline inspection: tensor_parallel must be a positive int, got {tensor_parallel!r}")
    group = ranks * tensor_parallel  # the ranks of one pipeline
    world_size = world_size or group
    if world_size % group:
        raise OptionsError(f"pipeline inspection: world_size={world_size} is not a multiple of the pipeline's {group} "
                           f"ranks ({ranks} stages' ranks x tp {tensor_parallel}); use world_size="
                           f"{group * max(1, world_size // group)} (those x data-parallel pipelines)")
    if optimizer not in OPTIMIZER_STATES:
        raise OptionsError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATES)}")
    plan = build_schedule(schedule, num_ranks=ranks, micro_batches=micro_batches, virtual_stages=v)
    inputs, loss = with_loss(example_inputs, loss_fn)
    total = inputs[0].shape[0] * group if inputs[0].dim() else 0  # as dpar.pipeline: every rank's slice
    if not total or total % micro_batches:
        raise OptionsError(
            f"pipeline inspection: micro_batches={micro_batches} does not divide the pipeline's batch of {total} rows "
            f"({group} ranks x the example's {total // group}); use one of "
            f"{[d for d in range(1, total + 1) if total % d == 0]}")
    rows = total // micro_batches
    spec = device_spec(device)
    timed_on = timing_device(spec) if profile_kernels else None
    if timed_on is not None:
        spec = dataclasses.replace(spec, name=f"{spec.name} (kernels timed on {timed_on.type})")
    split, costs = price_stages(model, loss, micro_batch_of(inputs, rows), stages, spec, split_points, ranks=ranks,
                                schedule=schedule, activations=activations, kernels_timed_on=timed_on)
    collectives = [{} for _ in costs]
    if tensor_parallel > 1:
        if pipeline is None:
            raise OptionsError("pipeline inspection: tensor_parallel > 1 reads the stage graphs dpar.pipeline builds; "
                               "call dpar.explain (or pass pipeline=dpar.pipeline)")
        collectives = _stage_collectives(model, inputs, loss, pipeline, stages=stages, micro_batches=micro_batches,
                                         schedule=schedule, split_points=split_points, ranks=ranks, tp=tensor_parallel)
    tp = tensor_parallel_cost(collectives, tensor_parallel, spec, read_off_graphs=tensor_parallel > 1)
    timeline = simulate(plan, action_cost(costs, tp), latency=hop_latency(costs))
    dp = world_size // group
    all_reduce = tuple(
        comm_time("all_reduce", sum(costs[s].parameter_bytes for s in plan.stages_of(r)) / tensor_parallel, dp, spec)
        if dp > 1 else 0.0
        for r in range(ranks)
    )
    return PipelineReport(
        model=type(model).__name__, world_size=world_size, data_parallel=dp, device=spec.name, optimizer=optimizer,
        micro_batch_rows=rows, split=split, stages=costs, schedule=plan, timeline=timeline, dp_all_reduce_s=all_reduce,
        tp=tp, activations=activations,
    )


def _stage_collectives(
    model: nn.Module, inputs: Sequence[torch.Tensor], loss: LossFn, pipeline: PipelineBuilder, *, stages: int,
    micro_batches: int, schedule: str, split_points: Sequence[str] | None, ranks: int, tp: int,
) -> list[Collectives]:
    """Each stage's collectives by graph, as ``dpar.pipeline`` over a ``("pp", "tp")`` mesh builds them: for each
    pipeline rank, a copy of the model cut and split on the first rank of its tp group in a fake world."""
    found: dict[int, Collectives] = {}
    for pp_rank in range(ranks):
        with fake_world(ranks * tp, rank=pp_rank * tp):
            mesh = init_device_mesh("cpu", (ranks, tp), mesh_dim_names=("pp", "tp"))
            step = pipeline(copy.deepcopy(model), loss, example_inputs=tuple(inputs), stages=stages,
                            micro_batches=micro_batches, schedule=schedule, mesh=mesh, split_points=split_points)
            found.update({s: graph_collectives(g) for s, g in step.graphs.items()})
    return [found[s] for s in range(stages)]


def block_collectives(
    model: nn.Module, prefix: str, micro_batch: Sequence[torch.Tensor], loss: LossFn, *, pipeline: PipelineBuilder,
) -> BlockCollectives:
    """The tp collectives of the first, a middle and the last block (``BlockCollectives``), read off the graphs
    ``pipeline`` (``dpar.pipeline``) builds at tp 2 on a copy of ``model`` whose block container ``prefix`` (as
    ``find_blocks`` names it) is cut to three blocks, one a stage, each micro-batch ``micro_batch``. A block's
    collectives carry its activations' bytes, which do not depend on the tp degree, nor does their count."""
    path = prefix.removeprefix("model.")
    dropped = list(model.get_submodule(path).children())[3:]
    cut = copy.deepcopy(model, memo={id(block): None for block in dropped})  # never a copy of the whole model
    container = cut.get_submodule(path)
    for key in [k for k, block in container._modules.items() if block is None]:
        del container._modules[key]
    blocks = len(container)
    # A stage a rank, split over tp 2; each rank's slice is one micro-batch.
    found = _stage_collectives(cut, tuple(micro_batch), loss, pipeline, stages=blocks, micro_batches=2 * blocks,
                               schedule="1f1b", split_points=None, ranks=blocks, tp=2)
    return BlockCollectives(first=found[0], middle=found[min(1, blocks - 1)], last=found[-1])


def print_pipeline_report(report: PipelineReport, console: Console | None = None) -> None:
    from rich.console import Console

    from dpar.inspect.render_text import _rich_table

    console = console or Console()
    console.rule(report.title)
    console.print(str(report.split), markup=False, highlight=False)
    for table in report.tables():
        console.print(_rich_table(table))
    console.print(report.summary(), markup=False, highlight=False)
