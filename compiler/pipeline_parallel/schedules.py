"""Pipeline schedules as data: each rank's ordered list of actions, printable and checkable.

A schedule is built once, before anything runs, so a wrong order is a ``ScheduleError`` naming
the rank and action at build time instead of a hang inside ``recv`` at step time.

[Note: how the orders are built, and why they cannot deadlock]
The executor's rule: a send never blocks; a receive blocks until the peer has issued the matching
send. Every rank here issues a receive immediately before the compute that reads it and a send
immediately after the compute that made it, so a rank can only wait at a receive, and then for
the compute on a neighbour that its send follows. No deadlock is then possible if the "compute A
must finish before compute B" relation (data dependencies plus each rank's program order) has no
cycle; the orders below are chosen so it has none, and ``check_deadlock_free`` verifies it by
replaying.

- GPipe: every forward, then every backward (micro-batches in order). Forwards only wait on
  forwards of lower stages, backwards on forwards and on backwards of higher stages.
- 1F1B: rank ``r`` runs ``w = min(p - 1 - r, m)`` warm-up forwards, then alternates
  F(i + w), B(i), then the remaining backwards. Its B(i) waits for rank ``r + 1``'s B(i), which
  that rank issues right after its own F(i + w - 1); that forward needs only rank ``r``'s
  F(i + w - 1), issued before B(i): every wait points at an action the peer reaches without
  waiting back. A rank holds at most ``w + 1 = p - r`` micro-batches' activations.
- Interleaved 1F1B (looping placement: stage ``s`` on rank ``s % p``, ``v`` stages per rank):
  forwards go in rounds of ``p`` micro-batches; within a round, chunk 0 for those ``p``
  micro-batches, then chunk 1, and so on; backwards in the same rounds with the chunks reversed.
  Rank ``r`` warms up with ``(v - 1) * p + 2 * (p - 1 - r)`` forwards: the last rank needs
  ``(v - 1) * p`` of them to reach micro-batch 0 on its last chunk, and each rank further up
  can run two more (one forward and one backward hop) before the first gradient comes back.
  Rounds of ``p`` are why ``m`` must be a multiple of ``p``: a micro-batch that leaves rank
  ``p - 1``'s chunk ``c`` must find rank 0 about to run chunk ``c + 1`` on it.
- ZB-H1: the backward is split into I (input gradient, on the critical path) and W (weight
  gradient, needed by nobody downstream). The order is 1F1B's with B replaced by I, and rank
  ``r`` runs W(i - r) after I(i): deferred W's shorten the chain of I's the last gradient climbs
  (the last rank runs its I(m-1) ``p - 1`` W-durations earlier), and they then fill what would
  otherwise be the cool-down bubble. Every rank then holds ``p`` micro-batches until their W (1F1B's peak,
  that of rank 0, on every rank). W waits only on its own rank's I, so no new cross-rank wait.
- ZBV (V placement: rank ``r`` holds stage ``r`` on the way down and stage ``2p - 1 - r`` on the
  way up, so rank ``p - 1`` hands stage ``p - 1``'s output to stage ``p`` without a send and rank
  0 holds both the embedding and the head): see [Note: the ZBV order].

[Note: the ZBV order]
Each rank's program is a table of phases, ``(repeats, pattern)``, in ``_ZBV_PHASES``; a pattern
names (op, leg), leg 0 the down stage and leg 1 the up stage, and each (op, leg) takes the next
micro-batch in turn. With F = I = W = 1 (each a chunk: half a rank's layers), rank ``r``:
1. ``2(p - r) - 1`` down forwards: micro-batch 0 reaches rank ``r`` at ``r`` and comes back up to
   it at ``2p - 1 - r``; the down forwards fill exactly that gap.
2. ``r`` pairs (up F, down F): the up forwards now arrive every other unit (the rank below
   alternates the same way), a down forward fills each gap.
3. ``p - r`` triples (up F, I, W): the first gradient starts at rank 0 (the loss is on its up
   stage) and comes down one rank per I; the W's after each I fill the wait for the next.
4. The steady state, (down F, I, W, up F, I, W) per micro-batch, then the same without the down F
   once the down forwards are done (rank ``r`` is ``p - 1 - r`` forwards ahead on the down leg).
5. The cool-down: ``r`` pairs of I (down, up), ``p - r`` pairs (down I, W), the remaining W's.
The phases' counts assume ``M = max(m, 2p - 1)`` micro-batches (phase 1 on rank 0 needs
``2p - 1``); with fewer, the order is built for ``M`` and the actions of micro-batches ``>= m``
dropped on every rank: removing every action of a micro-batch removes no precedence between the
others (program order is transitive), so the shorter order cannot deadlock either.
Memory: counted from F until W, rank ``r`` holds at most ``min(2p, 2m, m + 1 + r)`` chunks: with
``m >= 2p - 1``, ``2p`` on every rank, i.e. ``p`` micro-batches' worth of its layers, 1F1B's peak
(rank 0's) and ZB-H1's. The bubble is in
[Note: the ZBV bubble] in simulate.py; ``replay`` checks every order for deadlocks, and the tests
simulate every (p, m) up to 8 ranks and 24 micro-batches against the formula.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterator, Sequence

from dpar.core.errors import OptionsError, ScheduleError, TooFewMicroBatchesError
from dpar.core.pipeline_program import Action, Op, PipelineSchedule

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")
ZERO_BUBBLE = ("zb_h1", "zbv")
"""The schedules that split each backward into I and W: a stage's step ends with its last W."""

_F, _I, _W = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
_ZBV_PHASES: tuple[tuple[Callable[[int, int, int], int], tuple[tuple[Op, int], ...]], ...] = (
    # (repeats as a function of (p, M, r), pattern of (op, leg)); see [Note: the ZBV order]
    (lambda p, M, r: 2 * (p - r) - 1, ((_F, 0),)),
    (lambda p, M, r: r, ((_F, 1), (_F, 0))),
    (lambda p, M, r: p - r, ((_F, 1), (_I, 1), (_W, 1))),
    (lambda p, M, r: M - 2 * p + 1 + r, ((_F, 0), (_I, 0), (_W, 0), (_F, 1), (_I, 1), (_W, 1))),
    (lambda p, M, r: p - 1 - r, ((_I, 0), (_W, 0), (_F, 1), (_I, 1), (_W, 1))),
    (lambda p, M, r: r, ((_I, 0), (_I, 1))),
    (lambda p, M, r: p - r, ((_I, 0), (_W, 0))),
    (lambda p, M, r: r, ((_W, 1), (_W, 0))),
)


def stages_per_rank(name: str, virtual_stages: int | None = None) -> int:
    """How many stages each rank holds: ``virtual_stages`` (interleaved, default 2), 2 for zbv, else 1."""
    if name == "zbv":
        return 2
    return virtual_stages or (2 if name == "interleaved_1f1b" else 1)


def stage_placement(name: str, num_ranks: int, stages: int) -> tuple[int, ...]:
    """The rank of each stage: a V for zbv (stages ``r`` and ``2p - 1 - r`` on rank ``r``), else looping."""
    if name == "zbv":
        return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(stages))
    return tuple(s % num_ranks for s in range(stages))


def min_micro_batches(name: str, num_ranks: int) -> int:
    """The fewest micro-batches the schedule's order runs: interleaved's rounds need ``num_ranks``; every
    other order is built for any ``m >= 1`` (zbv by dropping what its phases would add beyond ``m``)."""
    return num_ranks if name == "interleaved_1f1b" else 1


def _zbv_order(p: int, m: int, rank: int) -> Iterator[tuple[Op, int, int]]:
    """(op, leg, micro-batch) of one rank's compute actions under zbv; see [Note: the ZBV order]."""
    planned = max(m, 2 * p - 1)
    taken = dict.fromkeys(((op, leg) for op in (_F, _I, _W) for leg in (0, 1)), 0)
    for repeats, pattern in _ZBV_PHASES:
        for _ in range(repeats(p, planned, rank)):
            for op, leg in pattern:
                i, taken[op, leg] = taken[op, leg], taken[op, leg] + 1
                if i < m:
                    yield op, leg, i


def _compute_order(name: str, p: int, m: int, v: int, rank: int) -> Iterator[tuple[Op, int, int]]:
    """(op, chunk, micro-batch) of one rank's compute actions; see the Note above."""
    F, B, I, W = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    if name == "zbv":
        yield from _zbv_order(p, m, rank)
        return
    if name == "gpipe":
        yield from ((F, 0, i) for i in range(m))
        yield from ((B, 0, i) for i in range(m))
        return
    if name == "interleaved_1f1b":
        def nth(k: int, backward: bool) -> tuple[int, int]:
            within = k % (p * v)
            chunk = within // p
            return (v - 1 - chunk if backward else chunk), k // (p * v) * p + within % p
        warmup = min((v - 1) * p + 2 * (p - 1 - rank), m * v)
        forwards = [(F, *nth(k, False)) for k in range(m * v)]
        backwards = [(B, *nth(k, True)) for k in range(m * v)]
    else:
        warmup = min(p - 1 - rank, m)
        forwards = [(F, 0, i) for i in range(m)]
        backwards = [(B if name == "1f1b" else I, 0, i) for i in range(m)]
    delay = rank if name == "zb_h1" else None
    yield from forwards[:warmup]
    for k, backward in enumerate(backwards):
        if warmup + k < len(forwards):
            yield forwards[warmup + k]
        yield backward
        if delay is not None and k >= delay:
            yield W, 0, k - delay
    if delay is not None:
        yield from ((W, 0, i) for i in range(max(0, m - delay), m))


def _with_communication(placement: tuple[int, ...], rank: int, order: Iterator[tuple[Op, int, int]]
                        ) -> tuple[Action, ...]:
    """Each compute action with its receive just before and its send just after; ``chunk`` is the
    index of the stage among the rank's stages, in stage order."""
    mine = [s for s, holder in enumerate(placement) if holder == rank]
    last = len(placement) - 1
    actions: list[Action] = []
    for op, chunk, i in order:
        s = mine[chunk]
        crosses_down = s > 0 and placement[s - 1] != rank  # the predecessor stage is on another rank
        crosses_up = s < last and placement[s + 1] != rank
        if op is Op.FORWARD:
            actions += [Action(Op.RECV_ACTIVATION, s, i)] if crosses_down else []
            actions.append(Action(op, s, i))
            actions += [Action(Op.SEND_ACTIVATION, s, i)] if crosses_up else []
        elif op is Op.BACKWARD_WEIGHT:
            actions.append(Action(op, s, i))
        else:
            actions += [Action(Op.RECV_GRADIENT, s, i)] if crosses_up else []
            actions.append(Action(op, s, i))
            actions += [Action(Op.SEND_GRADIENT, s, i)] if crosses_down else []
    return tuple(actions)


def check_name(name: str) -> None:
    if name not in SCHEDULES:
        close = difflib.get_close_matches(str(name).lower(), SCHEDULES, n=1, cutoff=0.3)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise OptionsError(f"unknown pipeline schedule {name!r}{hint}; choose one of {list(SCHEDULES)}")


def build_schedule(name: str, *, num_ranks: int, micro_batches: int, virtual_stages: int | None = None,
                   checked: bool = True) -> PipelineSchedule:
    """The named schedule for ``num_ranks`` ranks and ``micro_batches`` micro-batches, checked.

    ``virtual_stages``: stages per rank; interleaved_1f1b needs >= 2, zbv always has 2 (a V), the others 1.
    ``checked=False`` skips the deadlock check for a caller that ``simulate``s it at once (which raises
    the same error): replaying a deep schedule twice is what the pipeline planner would spend its time on."""
    check_name(name)
    p, m = num_ranks, micro_batches
    v = virtual_stages if virtual_stages is not None else 2 if name == "zbv" else 1
    for label, value in (("num_ranks", p), ("micro_batches", m), ("virtual_stages", v)):
        if not isinstance(value, int) or value < 1:
            raise OptionsError(f"{label} must be an integer >= 1, got {value!r}")
    fewest = min_micro_batches(name, p)
    if m < fewest:
        raise TooFewMicroBatchesError(
            f"{name} needs at least {fewest} micro-batches on {p} ranks (it runs them in rounds of the ranks), "
            f"got {m}; use micro_batches={fewest} (or a multiple of it), or schedule='1f1b' or 'zb_h1', which run any number")
    if name == "zbv":
        if v != 2:
            raise OptionsError(f"zbv places exactly 2 stages on each rank (a V), got virtual_stages={v}; drop "
                               "virtual_stages, or use schedule='interleaved_1f1b' for another number of stages per rank")
    elif name == "interleaved_1f1b":
        if v < 2:
            raise OptionsError(f"interleaved_1f1b needs virtual_stages >= 2, got {v}; "
                               "pass virtual_stages=2 (or more), or use schedule='1f1b' for one stage per rank")
        if m % p:
            up = m + p - m % p
            fix = f"micro_batches={up}" + (f" or {m - m % p}" if m > p else "")
            raise OptionsError(f"interleaved_1f1b runs micro-batches in rounds of num_ranks={p}, so micro_batches "
                               f"must be a multiple of {p}, got {m}; use {fix}, or schedule='1f1b'")
    elif v != 1:
        raise OptionsError(f"virtual_stages={v} applies only to schedule='interleaved_1f1b'; "
                           f"drop it or use that schedule")
    placement = stage_placement(name, p, p * v)
    schedule = PipelineSchedule(name, p, p * v, m, tuple(
        _with_communication(placement, r, _compute_order(name, p, m, v, r)) for r in range(p)), placement)
    if checked:
        check_deadlock_free(schedule)
    return schedule


# A receive's matching send: RA(s, i) is fed by SA(s - 1, i), RG(s, i) by SG(s + 1, i).
_MATCH = {Op.RECV_ACTIVATION: (Op.SEND_ACTIVATION, -1), Op.RECV_GRADIENT: (Op.SEND_GRADIENT, +1)}
_BACKWARDS = (Op.BACKWARD, Op.BACKWARD_INPUT)


def _needs(schedule: PipelineSchedule, rank: int, a: Action) -> list[tuple[Action, ...]]:
    """What ``a`` needs done earlier on its own rank, each need a tuple of acceptable actions."""
    s, i, last = a.stage, a.micro_batch, schedule.num_stages - 1
    local_down = s > 0 and schedule.stage_rank(s - 1) == rank
    local_up = s < last and schedule.stage_rank(s + 1) == rank
    if a.op is Op.FORWARD:
        if s == 0:
            return []
        return [(Action(Op.FORWARD, s - 1, i),)] if local_down else [(Action(Op.RECV_ACTIVATION, s, i),)]
    if a.op in _BACKWARDS:
        grad = [] if s == last else [(Action(Op.BACKWARD, s + 1, i), Action(Op.BACKWARD_INPUT, s + 1, i))] \
            if local_up else [(Action(Op.RECV_GRADIENT, s, i),)]
        return [(Action(Op.FORWARD, s, i),), *grad]
    if a.op is Op.BACKWARD_WEIGHT:
        return [(Action(Op.BACKWARD_INPUT, s, i),)]
    if a.op is Op.SEND_ACTIVATION:
        return [(Action(Op.FORWARD, s, i),)]
    if a.op is Op.SEND_GRADIENT:
        return [(Action(Op.BACKWARD, s, i), Action(Op.BACKWARD_INPUT, s, i))]
    return []


def _check_contents(schedule: PipelineSchedule) -> None:
    """Every action on the rank holding its stage, every send/recv across a real boundary, and
    per (stage, micro-batch) exactly one F and one B, or one I and one W."""
    counts: dict[tuple[int, int], list[str]] = {}
    for rank, program in enumerate(schedule.actions):
        for n, a in enumerate(program):
            if not (0 <= a.stage < schedule.num_stages and 0 <= a.micro_batch < schedule.micro_batches):
                raise ScheduleError(f"rank {rank}, action {n} ({a}): stage or micro-batch out of range "
                                    f"({schedule.num_stages} stages, {schedule.micro_batches} micro-batches); "
                                    "fix the schedule's builder")
            if schedule.stage_rank(a.stage) != rank:
                raise ScheduleError(f"rank {rank}, action {n} ({a}): stage {a.stage} lives on rank "
                                    f"{schedule.stage_rank(a.stage)}; move the action to that rank's program")
            if a.op.is_compute:
                counts.setdefault((a.stage, a.micro_batch), []).append(a.op.value)
                continue
            step = -1 if a.op in (Op.RECV_ACTIVATION, Op.SEND_GRADIENT) else +1
            peer = a.stage + step
            if not 0 <= peer < schedule.num_stages or schedule.stage_rank(peer) == rank:
                raise ScheduleError(f"rank {rank}, action {n} ({a}): no stage on another rank sits across that "
                                    "boundary; drop the action")
    for s in range(schedule.num_stages):
        for i in range(schedule.micro_batches):
            got = sorted(counts.get((s, i), []))
            if got not in (["B", "F"], ["F", "I", "W"]):
                raise ScheduleError(
                    f"rank {schedule.stage_rank(s)}: stage {s}, micro-batch {i} has compute actions {got or 'none'}; "
                    f"it needs exactly one F and one B (or one F, one I and one W)")


def replay(schedule: PipelineSchedule, duration: Callable[[Action], float] | None = None,
           latency: float = 0.0) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Run every rank's program under the executor's rules; (start, end) of each action.

    Compute actions last ``duration(action)`` (0 without one); a send costs nothing and its
    message lands ``latency`` later; a receive ends when its message has landed. Raises
    ``ScheduleError`` at the first action that can never proceed."""
    return timed(schedule, execution_order(schedule), duration, latency)


def timed(schedule: PipelineSchedule, order: Sequence[tuple[int, int]],
          duration: Callable[[Action], float] | None = None, latency: float = 0.0,
          ) -> tuple[tuple[tuple[float, float], ...], ...]:
    """``replay``'s times along an ``execution_order`` of the schedule: which action waits for which does not
    depend on how long they take, so one order serves every set of costs (the planner prices several)."""
    clock = [0.0] * schedule.num_ranks
    times: list[list[tuple[float, float]]] = [[] for _ in range(schedule.num_ranks)]
    landed: dict[tuple[Op, int, int], float] = {}  # (op, stage, micro-batch) of a send: a tuple is cheaper than an Action
    for r, n in order:
        a = schedule.actions[r][n]
        start = clock[r]
        if a.op in _MATCH:
            op, step = _MATCH[a.op]
            clock[r] = max(clock[r], landed.pop((op, a.stage + step, a.micro_batch)))
        elif not a.op.is_compute:
            landed[a.op, a.stage, a.micro_batch] = clock[r] + latency
        elif duration:
            clock[r] += duration(a)
        times[r].append((start, clock[r]))
    return tuple(tuple(t) for t in times)


def execution_order(schedule: PipelineSchedule) -> tuple[tuple[int, int], ...]:
    """(rank, action index) in an order the executor's rules let every action run: each rank's program in
    turn until it waits for a message not yet sent. Raises ``ScheduleError`` at the first action that can
    never proceed."""
    _check_contents(schedule)
    p = schedule.num_ranks
    pc = [0] * p
    done: list[set[Action]] = [set() for _ in range(p)]
    order: list[tuple[int, int]] = []
    landed: set[Action] = set()  # sends not yet received
    issued: set[Action] = set()
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pc[r] < len(schedule.actions[r]):
                a = schedule.actions[r][pc[r]]
                for options in _needs(schedule, r, a):
                    if not any(option in done[r] for option in options):
                        raise ScheduleError(
                            f"rank {r}, action {pc[r]} ({a}) needs {' or '.join(map(str, options))} earlier on the "
                            "same rank, "
                            f"and the program does not run it before; reorder rank {r}'s actions")
                if a.op in _MATCH:
                    op, step = _MATCH[a.op]
                    send = Action(op, a.stage + step, a.micro_batch)
                    if send not in landed:
                        break
                    landed.remove(send)
                elif not a.op.is_compute:
                    if a in issued:
                        raise ScheduleError(f"rank {r}, action {pc[r]} ({a}) sends a second time; drop the duplicate")
                    issued.add(a)
                    landed.add(a)
                order.append((r, pc[r]))
                done[r].add(a)
                pc[r] += 1
                progressed = True
    stuck = [r for r in range(p) if pc[r] < len(schedule.actions[r])]
    if stuck:
        lines = []
        for r in stuck:
            a = schedule.actions[r][pc[r]]
            op, step = _MATCH[a.op]
            send = Action(op, a.stage + step, a.micro_batch)
            peer = schedule.stage_rank(send.stage)
            why = "which has already been received" if send in issued else (
                f"which rank {peer} never issues" if send not in schedule.actions[peer] else
                f"which rank {peer} issues only after it is blocked itself")
            lines.append(f"rank {r}, action {pc[r]} ({a}) waits forever for {send} from rank {peer}, {why}")
        lines.sort(key=lambda line: "blocked itself" in line)  # the root causes first
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(lines)
                            + ". Every receive needs its peer to reach the matching send without waiting on it; "
                              "reorder the programs")
    return tuple(order)


def check_deadlock_free(schedule: PipelineSchedule) -> None:
    """Raise ``ScheduleError`` naming the rank and action that could never proceed, if any."""
    replay(schedule)


def bubble_formula(name: str, num_ranks: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of the step on every rank with equal-cost actions (F = B, or F = I = W).

    Exact for the orders built here (``simulate`` checks them): GPipe and 1F1B
    (p-1)/(m+p-1); interleaved (p-1)/(v m+p-1) with F, B the cost of one chunk; ZB-H1 and ZBV
    (F = I = W the cost of one of its two chunks), see [Note: the ZB-H1 bubble] and
    [Note: the ZBV bubble] in simulate.py."""
    p, m, v = num_ranks, micro_batches, virtual_stages
    if name == "zbv":
        idle = max(p - 1, 4 * p - 2 - 2 * m)
        return idle / (6 * m + idle)
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb_h1":
        span = max(3 * m + p - 1, 2 * m + 2 * p - 1)
        return (span - 3 * m) / span
    return (p - 1) / (m + p - 1)


class PipelineBubbleWarning(UserWarning):
    """Too few micro-batches for the stages: ranks idle a large share of each step."""


def warn_if_bubble_large(name: str, num_ranks: int, micro_batches: int, virtual_stages: int = 1) -> None:
    """Warn (``PipelineBubbleWarning``) when micro_batches < 4 x stages, naming the bubble and the fix."""
    p, m, v = num_ranks, micro_batches, virtual_stages
    if p == 1 or m >= 4 * p:  # one rank has no bubble
        return
    now, fixed = bubble_formula(name, p, m, v), bubble_formula(name, p, 4 * p, v)
    stages = (f"{p} ranks x 2 stages in a V" if name == "zbv" else f"{p} stages" if v == 1
              else f"{p} ranks x {v} virtual stages")
    warnings.warn(PipelineBubbleWarning(
        f"pipeline schedule {name!r} with {stages} and {m} micro-batches leaves every rank idle "
        f"{now:.1%} of the step (bubble); use micro_batches >= {4 * p} (4 x {p}) to bring it to "
        f"{fixed:.1%}, e.g. a larger batch or smaller micro-batches"), stacklevel=2)
