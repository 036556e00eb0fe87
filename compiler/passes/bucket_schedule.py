"""Which gradients share an all-reduce, chosen from what the backward and the all-reduces cost.

[Note: the bucket schedule]
The gradients come in readiness order, each with ``ready_s``: the seconds of
backward compute (the roofline of ``costs.node_cost``) done when it is produced;
the backward takes ``backward_s`` in all. A bucket's all-reduce can start once
its last gradient is ready, and the all-reduces run one after another. Of an
all-reduce's ``c`` seconds, ``overlap * c`` can hide under the compute still to
run; the rest, ``(1 - overlap) * c``, lengthens the step wherever it runs (on a
CPU gloo's thread and the compute thread share the cores). So, for buckets
b = 1..m with ready times R_b, the hidable parts finish at

    F_b = max(R_b, F_(b-1)) + overlap * c_b,      F_0 = 0

and the step runs past the end of the backward by

    E = sum_b (1 - overlap) * c_b + max(0, F_m - backward_s).

The plan minimises E over every way to cut the sequence into consecutive
buckets whose flat buffer fits in ``cap_bytes`` (a gradient larger than the cap
travels alone); among plans within float noise of the least E it takes the
fewest buckets. Cutting more often starts communication earlier but pays each
all-reduce's latency again: with overlap 0 nothing hides and the plan is the
fewest buckets the cap allows, with overlap 1 the first bucket closes as soon
as waiting longer would leave the all-reduces more than the compute left.

The search is a dynamic program over prefixes: a plan of the first j gradients
is summed up by (exposed seconds so far, F, bucket count), and a longer plan's
E grows with each of them, so only the plans of a prefix that no other plan of
it beats on all three are kept (a Pareto front; a handful in practice). The
plan depends on the graph and the device preset alone, so every rank builds
the same buckets (``agree`` checks the fingerprints before compiling).
Gradients of different dtypes never share a bucket; each dtype is planned on
its own (their all-reduces are taken not to wait for one another's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from dpar.compiler.passes.buckets import Bucket, Gradient

_TIE_REL, _TIE_ABS = 1e-9, 1e-12  # plans this close in E are equally good


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The best ways found to bucket a prefix: what its buckets cost so far, and the cut before it."""

    exposed: float  # sum of (1 - overlap) * c
    finish: float  # F of its last bucket
    count: int
    start: int  # the last bucket is gradients[start:end]
    previous: _Plan | None


def step_overrun(
    ready_s: Sequence[float], comm_s: Sequence[float], *, backward_s: float, overlap: float
) -> float:
    """E of [Note: the bucket schedule] for buckets ready at ``ready_s`` whose all-reduces take ``comm_s``."""
    finish, exposed = 0.0, 0.0
    for ready, c in zip(ready_s, comm_s):
        finish = max(ready, finish) + overlap * c
        exposed += (1.0 - overlap) * c
    return exposed + max(0.0, finish - backward_s)


def schedule_buckets(
    gradients: Sequence[Gradient],
    *,
    backward_s: float,
    all_reduce_s: Callable[[int], float],
    overlap: float,
    cap_bytes: int,
) -> list[Bucket]:
    """Buckets that end the step soonest after the backward (see [Note: the bucket schedule]),
    each with the reason it closed where it did, in the order their all-reduces are issued."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be within [0, 1], got {overlap}")
    ordered = sorted(gradients, key=lambda g: (g.ready_s, g.ready_at, g.output_index))
    by_dtype: dict[torch.dtype, list[Gradient]] = {}
    for grad in ordered:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    planned = [
        bucket
        for grads in by_dtype.values()
        for bucket in _explained(grads, _cuts(grads, backward_s, all_reduce_s, overlap, cap_bytes),
                                 backward_s, all_reduce_s, overlap, cap_bytes)
    ]
    planned.sort(key=lambda b: (max(g.ready_s for g in b.gradients), b.ready_at))
    return [dataclasses.replace(b, index=i) for i, b in enumerate(planned)]


def _cuts(
    grads: Sequence[Gradient], backward_s: float, all_reduce_s: Callable[[int], float], overlap: float, cap_bytes: int
) -> list[tuple[int, int]]:
    """The buckets of the least-E plan of ``grads`` (one dtype), as (start, end) slices."""
    prefix_bytes = [0]
    for g in grads:
        prefix_bytes.append(prefix_bytes[-1] + g.nbytes)
    fronts: list[list[_Plan]] = [[_Plan(0.0, 0.0, 0, 0, None)]]
    for end in range(1, len(grads) + 1):
        ready = grads[end - 1].ready_s
        candidates = []
        for start in range(end - 1, -1, -1):
            nbytes = prefix_bytes[end] - prefix_bytes[start]
            if start < end - 1 and nbytes > cap_bytes:
                break  # longer buckets only grow
            c = all_reduce_s(nbytes)
            for plan in fronts[start]:
                candidates.append(_Plan(
                    plan.exposed + (1.0 - overlap) * c, max(ready, plan.finish) + overlap * c, plan.count + 1, start, plan,
                ))
        fronts.append(_pareto(candidates))
    best = min(_overrun(p, backward_s) for p in fronts[-1])
    tied = [p for p in fronts[-1] if _overrun(p, backward_s) <= best + max(_TIE_ABS, _TIE_REL * abs(best))]
    plan: _Plan | None = min(tied, key=lambda p: (p.count, _overrun(p, backward_s)))
    cuts, end = [], len(grads)
    while plan is not None and plan.previous is not None:
        cuts.append((plan.start, end))
        end, plan = plan.start, plan.previous
    return cuts[::-1]


def _overrun(plan: _Plan, backward_s: float) -> float:
    return plan.exposed + max(0.0, plan.finish - backward_s)


def _pareto(plans: list[_Plan]) -> list[_Plan]:
    """The plans no other one matches or beats on exposed time, finish and bucket count together."""
    kept: list[_Plan] = []
    for p in sorted(plans, key=lambda p: (p.count, p.exposed, p.finish)):
        if not any(k.exposed <= p.exposed and k.finish <= p.finish for k in kept):
            kept.append(p)
    return kept


def _explained(
    grads: Sequence[Gradient],
    cuts: Sequence[tuple[int, int]],
    backward_s: float,
    all_reduce_s: Callable[[int], float],
    overlap: float,
    cap_bytes: int,
) -> list[Bucket]:
    """The buckets of ``cuts``, each with why it closed where it did, in numbers."""
    buckets = []
    for start, end in cuts:
        members = tuple(grads[start:end])
        nbytes = sum(g.nbytes for g in members)
        c = all_reduce_s(nbytes)
        ready = members[-1].ready_s
        if len(cuts) == 1 and overlap == 0.0:
            why = (f"one bucket: on this device communication does not overlap compute (overlap={overlap:g}), "
                   f"so each extra all-reduce only adds its latency; {_mb(nbytes)}, all-reduce {_ms(c)}")
        else:
            why = (f"ready at {_ms(ready)} of the {_ms(backward_s)} backward; {_mb(nbytes)}, all-reduce {_ms(c)}, "
                   f"{_ms(max(0.0, backward_s - ready))} of compute left to hide it under")
            if end < len(grads) and nbytes + grads[end].nbytes > cap_bytes:
                why = f"cap reached: {grads[end].name} would take it past {_mb(cap_bytes)}; " + why
        buckets.append(Bucket(index=0, dtype=members[0].dtype, gradients=members, reason=why))
    return buckets


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"
