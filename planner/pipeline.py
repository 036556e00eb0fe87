"""``plan_pipeline``: how many pipeline stages (pp) and data-parallel pipelines (dp = world / pp).

[Note: choosing the pipeline degree]
Every divisor ``pp`` of the world size up to the model's number of blocks is a candidate, with
``dp = world / pp`` pipelines side by side. The global batch is cut into micro-batches of
``micro_batch_rows`` rows (one capture, at that shape, serves every candidate), so a pipeline
runs ``m = rows / (dp x micro_batch_rows)`` of them: a deeper pipeline gets more micro-batches,
which is what keeps its bubble down. Each candidate is cut (``split_stages``), its stages priced
as ``dpar inspect`` prices them ([Note: the pipeline cost model] in ``compiler/pipeline_parallel/costs.py``)
and its schedule replayed with those costs. Its modelled step:

    step = pipeline span (compute + bubble + sends on the critical path) + dp all-reduce of the
           largest stage's gradients (after the span, not overlapped: the same for every pp)

reported beside its parts: ``compute_s`` (the busiest rank's m x (F + B)), the schedule's bubble
formula and ``bubble_s = compute_s x b / (1 - b)`` (equal stages, free sends: span = compute_s +
bubble_s exactly), one send's time. Memory per rank: its stage's parameters, gradients and
optimizer state, plus the activations of the micro-batches it holds at once (1F1B: ``p - r`` on
rank ``r``; GPipe: all ``m``; ZB-H1: ``p`` everywhere), the largest rank's against the budget.
The fastest candidate that fits wins; ties go to the smaller pp (fewer stages, fewer sends).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn as nn

from dpar.compiler.pipeline_parallel.schedules import bubble_formula, build_schedule
from dpar.compiler.pipeline_parallel.simulate import simulate
from dpar.compiler.pipeline_parallel.split import capture, find_blocks, split_stages
from dpar.compiler.costs import DeviceSpec, comm_time, device_spec
from dpar.compiler.memory import OPTIMIZER_STATES
from dpar.compiler.pipeline_parallel.costs import (
    LossFn, StageCost, action_cost, cut_and_price, hop_latency, micro_batch_of, with_loss,
)
from dpar.core.errors import OptionsError, PipelineMemoryError

PLANNED_SCHEDULES = ("gpipe", "1f1b", "zb_h1")
"""One stage per rank; interleaved_1f1b's virtual stages are not searched."""


@dataclasses.dataclass(frozen=True)
class PipelineCandidate:
    """One (pp, dp) and what it costs per step on one rank; see [Note: choosing the pipeline degree]."""

    pp: int
    dp: int
    micro_batches: int
    compute_s: float
    bubble: float  # the schedule's formula
    bubble_s: float
    send_s: float  # one boundary's send per micro-batch (the largest)
    pipeline_s: float  # the simulated span
    dp_all_reduce_s: float
    step_s: float
    state_bytes: int  # the fullest rank's parameters + gradients + optimizer state
    activation_bytes: int  # the fullest rank's activations held at its peak
    fits: bool

    @property
    def memory_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    world_size: int
    schedule: str
    micro_batch_rows: int
    memory_budget_bytes: float | None
    device: str
    optimizer: str
    candidates: tuple[PipelineCandidate, ...]
    choice: PipelineCandidate

    @property
    def pp(self) -> int:
        return self.choice.pp

    @property
    def dp(self) -> int:
        return self.choice.dp

    def __str__(self) -> str:
        budget = "no memory budget" if self.memory_budget_bytes is None else f"{self.memory_budget_bytes / 1e9:g} GB per rank"
        lines = [
            f"pipeline plan: pp={self.pp} x dp={self.dp} on {self.world_size} ranks ({self.schedule}, micro-batches of "
            f"{self.micro_batch_rows} rows, {budget}, {self.device}, {self.optimizer})",
            f"{'pp':>3} {'dp':>3} {'m':>4} {'compute':>11} {'bubble':>15} {'send':>10} {'span':>11} "
            f"{'dp all-red.':>11} {'step':>11} {'state GB':>9} {'act. GB':>9} fits",
        ]
        for c in self.candidates:
            mark = " <- chosen" if c is self.choice else ""
            lines.append(
                f"{c.pp:>3} {c.dp:>3} {c.micro_batches:>4} {_ms(c.compute_s)} {c.bubble:>5.1%} {_ms(c.bubble_s)} "
                f"{_ms(c.send_s, 10)} {_ms(c.pipeline_s)} {_ms(c.dp_all_reduce_s)} {_ms(c.step_s)} "
                f"{c.state_bytes / 1e9:>9.4f} {c.activation_bytes / 1e9:>9.4f} {'yes' if c.fits else 'no'}{mark}"
            )
        return "\n".join(lines)


def _ms(seconds: float, width: int = 11) -> str:
    return f"{seconds * 1e3:.4f} ms".rjust(width)


def plan_pipeline(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    world_size: int,
    memory_budget_gb: float | None,
    micro_batch_rows: int | None = None,
    schedule: str = "1f1b",
    loss_fn: LossFn | None = None,
    device: str | DeviceSpec = "h100",
    optimizer: str = "adamw",
) -> PipelinePlan:
    """The pipeline degree (and dp = world / pp) with the least modelled step that fits the budget.

    ``example_inputs`` is the **global** batch, as ``dpar.plan`` takes it (``loss_fn`` and the
    target as in ``dpar.explain(strategy="pipeline")``: with a loss the last input is the target,
    without one next-token cross-entropy is priced). ``micro_batch_rows`` defaults to one rank's
    share of the batch (``rows / world_size``). Raises ``PipelineMemoryError`` when no pp fits.
    """
    if schedule not in PLANNED_SCHEDULES:
        raise OptionsError(f"plan_pipeline: schedule {schedule!r} is not one of {list(PLANNED_SCHEDULES)} (one stage "
                           "per rank); plan with '1f1b' and inspect the interleaved schedule with dpar.explain")
    if optimizer not in OPTIMIZER_STATES:
        raise OptionsError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATES)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise OptionsError(f"plan_pipeline: world_size must be a positive int, got {world_size!r}")
    inputs, loss = with_loss(example_inputs, loss_fn)
    rows = inputs[0].shape[0]
    mbr = micro_batch_rows or rows // world_size
    if mbr < 1 or rows % mbr:
        raise OptionsError(f"plan_pipeline: micro_batch_rows={micro_batch_rows} does not divide the global batch of "
                           f"{rows} rows; use a divisor of {rows} (default: rows / world_size, {rows // world_size})")
    spec = device_spec(device)
    micro_batch = micro_batch_of(inputs, mbr)
    graph = capture(model, loss, micro_batch)
    _, blocks = find_blocks(graph)
    candidates = []
    for pp in (d for d in range(1, min(world_size, len(blocks)) + 1) if world_size % d == 0):
        dp = world_size // pp
        if rows % (dp * mbr):
            continue  # the dp pipelines cannot each take whole micro-batches
        split = split_stages(graph, model, pp)
        if any(not stage.blocks for stage in split.stages):
            continue
        candidates.append(_price(pp, dp, rows // (dp * mbr), cut_and_price(split, model, micro_batch, spec),
                                 schedule, spec, optimizer, memory_budget_gb))
    if not candidates:
        raise OptionsError(f"plan_pipeline: no pp divides world_size={world_size} with dp = world / pp splitting the "
                           f"batch of {rows} rows into micro-batches of {mbr}; use a batch that is a multiple of "
                           f"world_size x micro_batch_rows")
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_bytes)
        raise PipelineMemoryError(
            f"plan_pipeline: no pipeline degree fits {memory_budget_gb:g} GB per rank; the least memory is pp={least.pp} "
            f"with {least.memory_bytes / 1e9:.4g} GB ({least.state_bytes / 1e9:.4g} GB parameters, gradients and "
            f"optimizer state, {least.activation_bytes / 1e9:.4g} GB activations). Raise memory_budget_gb to at least "
            f"{least.memory_bytes / 1e9:.4g}, or cut the activations (smaller micro_batch_rows) or the state "
            f"(more ranks for more stages, an optimizer with less state, or a sharded strategy through dpar.plan)")
    choice = min(fitting, key=lambda c: (c.step_s, c.pp))
    return PipelinePlan(
        world_size=world_size, schedule=schedule, micro_batch_rows=mbr,
        memory_budget_bytes=None if memory_budget_gb is None else memory_budget_gb * 1e9,
        device=spec.name, optimizer=optimizer, candidates=tuple(candidates), choice=choice,
    )


def _price(
    pp: int, dp: int, m: int, costs: Sequence[StageCost], schedule: str, spec: DeviceSpec, optimizer: str,
    memory_budget_gb: float | None,
) -> PipelineCandidate:
    plan = build_schedule(schedule, num_ranks=pp, micro_batches=m)
    timeline = simulate(plan, action_cost(costs), latency=hop_latency(costs))
    compute = max(timeline.busy)
    b = bubble_formula(schedule, pp, m)
    state = [c.state_bytes(optimizer) for c in costs]
    activations = [timeline.peak_in_flight[c.index] * c.activation_bytes for c in costs]
    fullest = max(range(pp), key=lambda r: state[r] + activations[r])
    all_reduce = max(comm_time("all_reduce", c.parameter_bytes, dp, spec) for c in costs) if dp > 1 else 0.0
    memory = state[fullest] + activations[fullest]
    return PipelineCandidate(
        pp=pp, dp=dp, micro_batches=m, compute_s=compute, bubble=b, bubble_s=compute * b / (1 - b),
        send_s=hop_latency(costs), pipeline_s=timeline.span, dp_all_reduce_s=all_reduce,
        step_s=timeline.span + all_reduce, state_bytes=state[fullest], activation_bytes=activations[fullest],
        fits=memory_budget_gb is None or memory <= memory_budget_gb * 1e9,
    )
