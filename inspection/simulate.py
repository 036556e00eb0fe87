"""Replaying a step's schedule: one compute stream and one comm stream per rank.

[Note: the simulated schedule]
Each rank runs its program in order on its compute stream. A collective's issue
costs nothing there; it enters the rank's comm stream for its process group, which
runs that group's collectives one at a time in issue order. A collective starts once
every rank has issued it and every rank's stream for the group is free (a ring needs
all of them), and lasts its α-β time. Collectives of different groups run side by
side, as NCCL runs each communicator on its own stream (and gloo each group on its
own threads): a tensor-parallel all-reduce over NVLink does not queue behind a
data-parallel reduce-scatter over the NICs. Their sharing of a link is not
modelled. A wait blocks the compute stream until its collective has finished:
the time blocked is exposed communication.

Times are floats, or ``PathTime``s that also carry, as a sympy expression in
N, the sum of the durations along the path that made them: the step time's
``PathTime`` is then the closed form of the critical path at the simulated N
(a nested max over every path would be exact for all N, and unreadable).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Union

import sympy



@dataclasses.dataclass(frozen=True)
class PathTime:
    """A time at the simulated N, with the closed form of the path that led to it."""

    value: float
    compute: float = 0.0  # compute seconds along the path
    comm: sympy.Expr = sympy.Integer(0)  # communication along the path, in N

    def __add__(self, other: PathTime) -> PathTime:
        return PathTime(self.value + other.value, self.compute + other.compute, self.comm + other.comm)

    def __float__(self) -> float:
        return self.value

    @property
    def expr(self) -> sympy.Expr:
        return self.compute + self.comm


Time = Union[float, PathTime]


class OpKind(enum.Enum):
    COMPUTE = "compute"
    ISSUE = "issue"
    WAIT = "wait"


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a rank's program; ``collective`` numbers issue/wait pairs in issue order."""

    kind: OpKind
    name: str
    seconds: Time = 0.0  # compute time, or the collective's duration for ISSUE
    collective: int = -1
    graph: str = ""
    group: str = ""  # a collective's process group: each group has its own comm stream


@dataclasses.dataclass(frozen=True)
class Event:
    rank: int
    stream: str  # "compute" or "comm"
    name: str
    start: float
    end: float
    graph: str
    group: str = ""  # a comm event's process group


@dataclasses.dataclass(frozen=True)
class Schedule:
    events: tuple[Event, ...]
    step_time: Time


def _max(a: Time, b: Time) -> Time:
    return b if float(b) > float(a) else a


class _Rank:
    def __init__(self, program: Sequence[Op], zero: Time) -> None:
        self.program = program
        self.pc = 0
        self.compute_free = zero
        self.comm_free: dict[str, Time] = {}  # a comm stream per process group

    @property
    def done(self) -> bool:
        return self.pc == len(self.program)


def simulate(programs: Mapping[int, Sequence[Op]], *, record: bool = True) -> Schedule:
    """Run every rank's program to the end; ranks must issue the same collectives in order."""
    tracked = any(isinstance(op.seconds, PathTime) for p in programs.values() for op in p)
    zero: Time = PathTime(0.0) if tracked else 0.0
    ranks = {r: _Rank(p, zero) for r, p in programs.items()}
    issued: dict[int, dict[int, Time]] = {}  # collective -> rank -> issue time
    duration: dict[int, Time] = {}
    names: dict[int, tuple[str, str]] = {}
    groups: dict[int, str] = {}
    finished: dict[int, Time] = {}
    next_to_start = 0
    events: list[Event] = []

    def start_ready_collectives() -> None:
        nonlocal next_to_start
        while len(issued.get(next_to_start, {})) == len(ranks):
            c = next_to_start
            start = zero
            group = groups[c]
            for r, t in issued[c].items():
                start = _max(start, _max(t, ranks[r].comm_free.get(group, zero)))
            end = start + duration[c]
            for r, state in ranks.items():
                state.comm_free[group] = end
                if record:
                    events.append(Event(r, "comm", names[c][0], float(start), float(end), names[c][1], group))
            finished[c] = end
            next_to_start += 1

    while not all(s.done for s in ranks.values()):
        progressed = False
        for r, state in ranks.items():
            while not state.done:
                op = state.program[state.pc]
                if op.kind is OpKind.WAIT:
                    if op.collective not in finished:
                        break
                    state.compute_free = _max(state.compute_free, finished[op.collective])
                elif op.kind is OpKind.ISSUE:
                    issued.setdefault(op.collective, {})[r] = state.compute_free
                    duration[op.collective] = op.seconds
                    names[op.collective] = (op.name, op.graph)
                    groups[op.collective] = op.group
                    start_ready_collectives()
                else:
                    begin = state.compute_free
                    state.compute_free = begin + op.seconds
                    if record:
                        events.append(
                            Event(r, "compute", op.name, float(begin), float(state.compute_free), op.graph)
                        )
                state.pc += 1
                progressed = True
        if not progressed:
            stuck = {r: s.program[s.pc].name for r, s in ranks.items() if not s.done}
            raise RuntimeError(f"simulated ranks wait on collectives never issued by all: {stuck}")
    step = zero
    for state in ranks.values():
        step = _max(step, state.compute_free)
        for free in state.comm_free.values():
            step = _max(step, free)
    return Schedule(tuple(events), step)
