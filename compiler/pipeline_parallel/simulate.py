"""A schedule's timeline from per-action costs: when each rank is busy, idle, and how much it holds.

The executor measures the same figures from real timestamps; this is what they are checked
against, and what ``dpar inspect`` draws for any stage and micro-batch count without running.

[Note: the bubble convention]
The step span is from 0 to the end of the last action on any rank. A rank's bubble is the time
inside that span it is not computing (waiting at a receive, or done early), over the span. With
equal work per rank this is the same on every rank, and for GPipe and 1F1B it is
(p-1)/(m+p-1): the idle share of the step, not Megatron's bubble/ideal ratio (p-1)/m. Interleaved
1F1B with F and B the cost of one of a rank's ``v`` chunks gives (p-1)/(v m+p-1), Megatron's
(p-1)/(v m) in the same convention.

[Note: the ZB-H1 bubble]
Take F = I = W = 1 (so 1F1B's B = 2). Rank ``r`` starts its first forward at ``r`` and, with its
``p - r`` forwards before the first I back to back, finishes them at ``p``. The first I reaches
the last rank at ``p`` and climbs one rank per I (1, against 1F1B's B = 2), so rank ``r``'s first
I starts at ``2p - 1 - r``: ``r + (p - 1 - r) = p - 1`` idle so far on every rank. After that
nothing waits: deferring ``r`` W's lets rank ``r + 1``'s I's run two apart (F, I) while rank ``r``
catches up, and in the cool-down the deferred W's fill the gaps. The span is ``3m + p - 1`` and
the bubble (p-1)/(3m+p-1): (p-1) idle units per rank against 1F1B's 3(p-1), the paper's one third.
This needs m >= p (the paper's setting). With fewer, rank ``r < p - m`` runs out of forwards
before the first I returns and the last rank alternates F and I as forwards arrive, so its
I(m-1) ends at ``p + 2m - 1`` and rank 0's W(m-1) at ``2m + 2p - 1``: in general the span is
``max(3m + p - 1, 2m + 2p - 1)`` (equal at m = p).

Memory: counted from F until W, ZB-H1 holds ``p`` micro-batches on every rank (1F1B's peak, that
of rank 0, everywhere; the paper counts less for a micro-batch between I and W). Holding only
1F1B's ``p - r`` is not enough for this bubble: the last rank, holding one, must run F, I, W
of each micro-batch in turn, so its I(m-1) starts no earlier than ``3m + p - 3`` and rank 0's
W(m-1) ends no earlier than ``3m + 2p - 2``: two thirds of 1F1B's bubble, not one third.

[Note: the ZBV bubble]
Take F = I = W = 1 for one chunk (a stage of the V: half a rank's layers; the whole model is 2p
chunks), so a rank computes 6m. With ``m >= (3p - 1) / 2`` rank ``r`` starts at ``r`` and then never
waits: the phases of [Note: the ZBV order] in schedules.py are sized so that each awaited action
arrives just as the one before ends (the down forwards fill micro-batch 0's trip down and back up;
the W's fill the I's trip). Rank ``r`` ends at ``6m + r``, the span is ``6m + p - 1`` (rank
``p - 1``'s end) and every rank is idle ``r`` at the start and ``p - 1 - r`` at the end: p - 1 in
all, bubble (p-1)/(6m+p-1). In ZB-H1's units (F = I = W = one stage = two chunks) that is
(p-1)/2 idle units against ZB-H1's p - 1: half its bubble, at the same peak memory.
With fewer micro-batches, rank 0 finishes last: its down-leg I's come back from the bottom of the
V one every 3 units (I, W and a wait), the first at ``m + 4p - 1``, so the span is
``4m + 4p - 2`` and the idle time ``4p - 2 - 2m`` on every rank. In all:
idle = max(p - 1, 4p - 2 - 2m), bubble = idle / (6m + idle); the small-m regime is checked by the
simulator (every p <= 8, m <= 24 in the tests), not derived step by step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from dpar.compiler.pipeline_parallel.schedules import replay, timed
from dpar.core.pipeline_program import COMPUTE_OPS, Action, Op, PipelineSchedule


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) per compute action, and a send's latency until its receive can end."""

    forward: float = 1.0
    backward: float = 2.0  # the usual ~2x forward: two matrix products per forward one
    backward_input: float = 1.0
    backward_weight: float = 1.0
    latency: float = 0.0

    def __call__(self, action: Action) -> float:
        return {Op.FORWARD: self.forward, Op.BACKWARD: self.backward, Op.BACKWARD_INPUT: self.backward_input,
                Op.BACKWARD_WEIGHT: self.backward_weight}[action.op]


@dataclasses.dataclass(frozen=True)
class TimedAction:
    """One action's interval on its rank; ``stream``/``name``/``graph`` are what trace files show
    (``dpar.inspect.trace.write_schedule_trace``)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def stream(self) -> str:
        return "compute" if self.action.op.is_compute else "comm"

    @property
    def name(self) -> str:
        return str(self.action)

    @property
    def graph(self) -> str:
        return f"stage {self.action.stage}"


@dataclasses.dataclass(frozen=True)
class SimulatedTimeline:
    schedule: PipelineSchedule
    times: tuple[tuple[tuple[float, float], ...], ...] = dataclasses.field(repr=False)  # per rank, per action
    span: float
    busy: tuple[float, ...]  # compute time per rank
    peak_in_flight: tuple[int, ...]  # per stage: most micro-batches between F and their B or W

    @functools.cached_property
    def events(self) -> tuple[TimedAction, ...]:
        """Every action's interval, made when read: the planner replays thousands of schedules and reads only
        spans, busy times and peaks (16,384 ranks of Llama-3-405B: 6 s of its planning went to making these)."""
        return tuple(TimedAction(r, a, *t) for r, program in enumerate(self.schedule.actions)
                     for a, t in zip(program, self.times[r]))

    @property
    def ranks_shown(self) -> int:
        return self.schedule.num_ranks

    @property
    def bubble(self) -> tuple[float, ...]:
        """Idle share of the step span per rank; see [Note: the bubble convention]."""
        return tuple((self.span - b) / self.span if self.span else 0.0 for b in self.busy)

    def peak_in_flight_of_rank(self, rank: int) -> int:
        """Micro-batch activations a rank holds at once, over all its stages."""
        return _peak(a for a in self.schedule.actions[rank])


def _peak(actions: Any) -> int:
    held = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
            held -= 1
    return peak


def simulate(schedule: PipelineSchedule, costs: Costs | Callable[[Action], float] = Costs(),
             *, latency: float | None = None, order: Sequence[tuple[int, int]] | None = None) -> SimulatedTimeline:
    """Replay ``schedule`` with ``costs`` per compute action (a ``Costs`` or any function of the
    action, e.g. per-stage costs from the split); ``latency`` overrides ``Costs.latency``. ``order``: the
    schedule's ``execution_order``, found once where one schedule is replayed under several costs."""
    if latency is None:
        latency = costs.latency if isinstance(costs, Costs) else 0.0
    times = replay(schedule, costs, latency) if order is None else timed(schedule, order, costs, latency)
    busy = tuple(sum(end - start for a, (start, end) in zip(program, times[r]) if a.op in COMPUTE_OPS)
                 for r, program in enumerate(schedule.actions))
    span = max((end for ranks in times for _, end in ranks), default=0.0)
    peaks = tuple(_peak(a for a in schedule.actions[schedule.stage_rank(s)] if a.stage == s)
                  for s in range(schedule.num_stages))
    return SimulatedTimeline(schedule, times, span, busy, peaks)
