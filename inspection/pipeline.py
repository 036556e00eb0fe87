"""``dpar.explain(..., strategy="pipeline")``: the stage split, the schedule and its simulated timeline.

Everything comes from one process and no process group: the model and loss are captured at one
micro-batch's shape, cut into stages, each stage priced (``compiler/pipeline_parallel/costs.py``), the named schedule
built for the pipeline's ranks and replayed with those costs (``simulate``). The ranks of one
pipeline are simulated; at ``world_size = pp x dp`` the ``dp`` pipelines run the same and then
all-reduce each stage's gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from dpar.compiler.pipeline_parallel.schedules import bubble_formula, build_schedule, stages_per_rank
from dpar.compiler.pipeline_parallel.simulate import SimulatedTimeline, simulate
from dpar.core.pipeline_program import PipelineSchedule, StageSplit
from dpar.compiler.costs import DeviceSpec, comm_time, device_spec
from dpar.compiler.memory import OPTIMIZER_STATES
from dpar.compiler.pipeline_parallel.costs import (
    LossFn, StageCost, action_cost, hop_latency, micro_batch_of, price_stages, with_loss,
)
from dpar.inspect.report import Table, _mib, _time
from dpar.inspect.trace import write_schedule_trace
from dpar.core.errors import OptionsError

if TYPE_CHECKING:
    from rich.console import Console

ACTIONS_SHOWN = 10
"""A rank's program longer than twice this is printed as its first and last ``ACTIONS_SHOWN`` actions."""


@dataclasses.dataclass(frozen=True)
class PipelineReport:
    model: str
    world_size: int
    data_parallel: int  # pipelines side by side; world_size = ranks per pipeline x data_parallel
    device: str
    optimizer: str
    micro_batch_rows: int
    split: StageSplit
    stages: tuple[StageCost, ...]
    schedule: PipelineSchedule
    timeline: SimulatedTimeline
    dp_all_reduce_s: tuple[float, ...]  # per rank: its stages' gradients over the data-parallel ranks

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
        """Activations stage ``stage`` holds at its peak: its in-flight micro-batches' saved values."""
        return self.timeline.peak_in_flight[stage] * self.stages[stage].activation_bytes

    def rank_memory(self, rank: int) -> int:
        """Parameters, gradients, optimizer state and peak activations of the rank's stages (summed over
        its stages: an upper bound where a rank holds several)."""
        return sum(self.stages[s].state_bytes(self.optimizer) + self.held_activation_bytes(s)
                   for s in self.schedule.stages_of(rank))

    @property
    def title(self) -> str:
        v = self.schedule.num_stages // self.ranks
        layout = f"{self.ranks} ranks" + (" x 2 stages in a V" if self.schedule.name == "zbv" else
                                          f" x {v} virtual stages" if v > 1 else "")
        dp = f", {self.data_parallel} pipelines (dp)" if self.data_parallel > 1 else ""
        return (f"dpar pipeline report: {self.model}, {self.schedule.name} on {layout}{dp}, "
                f"{self.schedule.micro_batches} micro-batches of {self.micro_batch_rows} rows ({self.device})")

    def stage_table(self) -> Table:
        return Table(
            f"Stages (per micro-batch of {self.micro_batch_rows} rows)",
            ("stage", "rank", "blocks", "parameters", "parameter bytes", "forward FLOPs", "forward time",
             "saved activations", "sends to next"),
            tuple(
                (str(c.index), str(self.schedule.stage_rank(c.index)), _blocks(c.blocks), f"{c.parameter_numel:,}",
                 f"{c.parameter_bytes:,}", f"{c.flops / 1e6:,.2f} M", _time(c.forward_s), f"{c.activation_bytes:,}",
                 f"{c.send_bytes:,} B in {_time(c.send_s)}" if c.send_bytes else "-")
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
                 _mib(sum(self.stages[s].state_bytes(self.optimizer) for s in self.schedule.stages_of(r))),
                 _mib(self.rank_memory(r)), _time(self.dp_all_reduce_s[r]))
                for r in range(self.ranks)
            ),
        )

    def tables(self) -> list[Table]:
        return [self.stage_table(), self.schedule_table(), self.timeline_table()]

    def summary(self) -> str:
        hop = hop_latency(self.stages)
        return (f"step time {_time(self.step_time)} = span {_time(self.timeline.span)} + dp all-reduce "
                f"{_time(max(self.dp_all_reduce_s))}; backward = 2 x forward (zb_h1, zbv: I = W = forward), "
                f"each send {_time(hop)} (alpha-beta, largest boundary)")

    def save(self, path: str | Path) -> Path:
        """The simulated schedule as Perfetto JSON (a process per rank, compute and send/recv threads)."""
        return write_schedule_trace(self.timeline, path)


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
) -> PipelineReport:
    """Report on ``model`` cut into ``stages`` pipeline stages, without running it.

    ``example_inputs`` is one rank's slice as ``dpar.pipeline`` takes it: the pipeline's batch is
    that many rows times its ranks, cut into ``micro_batches``. With ``loss_fn`` the last input is
    the target; without, the model's output is taken as logits and priced with cross-entropy
    against targets shaped like the first input. ``virtual_stages`` (interleaved_1f1b, default 2)
    puts that many stages on each rank. ``world_size`` (default: the pipeline's ranks) adds
    ``world_size / ranks`` data-parallel pipelines, whose gradient all-reduce the step includes.
    """
    v = stages_per_rank(schedule, virtual_stages)
    if not isinstance(stages, int) or stages < 1 or stages % v:
        raise OptionsError(f"pipeline inspection: stages={stages} is not a positive multiple of virtual_stages={v}; "
                           "use a multiple of it (each rank holds virtual_stages stages)")
    ranks = stages // v
    world_size = world_size or ranks
    if world_size % ranks:
        raise OptionsError(f"pipeline inspection: world_size={world_size} is not a multiple of the pipeline's {ranks} "
                           f"ranks; use world_size={ranks * max(1, world_size // ranks)} (ranks x data-parallel pipelines)")
    if optimizer not in OPTIMIZER_STATES:
        raise OptionsError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATES)}")
    plan = build_schedule(schedule, num_ranks=ranks, micro_batches=micro_batches, virtual_stages=v)
    inputs, loss = with_loss(example_inputs, loss_fn)
    total = inputs[0].shape[0] * ranks if inputs[0].dim() else 0
    if not total or total % micro_batches:
        raise OptionsError(
            f"pipeline inspection: micro_batches={micro_batches} does not divide the pipeline's batch of {total} rows "
            f"({ranks} ranks x the example's {total // ranks}); use one of "
            f"{[d for d in range(1, total + 1) if total % d == 0]}")
    rows = total // micro_batches
    spec = device_spec(device)
    split, costs = price_stages(model, loss, micro_batch_of(inputs, rows), stages, spec, split_points, ranks=ranks,
                                schedule=schedule)
    timeline = simulate(plan, action_cost(costs), latency=hop_latency(costs))
    dp = world_size // ranks
    all_reduce = tuple(
        comm_time("all_reduce", sum(costs[s].parameter_bytes for s in plan.stages_of(r)), dp, spec) if dp > 1 else 0.0
        for r in range(ranks)
    )
    return PipelineReport(
        model=type(model).__name__, world_size=world_size, data_parallel=dp, device=spec.name, optimizer=optimizer,
        micro_batch_rows=rows, split=split, stages=costs, schedule=plan, timeline=timeline, dp_all_reduce_s=all_reduce,
    )


def print_pipeline_report(report: PipelineReport, console: Console | None = None) -> None:
    from rich.console import Console

    from dpar.inspect.render_text import _rich_table

    console = console or Console()
    console.rule(report.title)
    console.print(str(report.split), markup=False, highlight=False)
    for table in report.tables():
        console.print(_rich_table(table))
    console.print(report.summary(), markup=False, highlight=False)
