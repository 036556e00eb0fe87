"""The ILP: one layout for the model, one candidate per op, priced by the cost model, solved exactly.

[Note: the planner's ILP]
Binary ``z[L]`` picks the layout L (mesh roles and data-parallel mode), binary ``x[L,o,c]``
the candidate c of op o under L, with ``sum_c x[L,o,c] = z[L]``. Resharding on an edge
u -> v depends on both ends, so it is priced on product variables ``y[e,c1,c2]`` linearised
by ``sum_c2 y = x[u,c1]`` and ``sum_c1 y = x[v,c2]`` (with one-hot x this forces y to the
product; y is continuous). Gradients of a tensor read by several ops are summed per
placement before one conversion, so ``a[u,c1,q] >= sum of y`` over consumers that hand back
a gradient in placement q, for each consumer. The data-parallel overlap is
``e_phase >= dp_comm_phase - compute_phase`` and ``e_phase >= root_phase`` (the root bucket's collectives, which
nothing hides: [Note: the root bucket is never hidden] in ``costs.py``). A parameter read by two ops (tied
embedding and LM head) gets equal placements from both. The memory budget is one row.

Objective: compute + tp comm (a tp layout's batch gather priced on z[L]) + exposed dp comm,
in units of the ideal step (the single-device compute time over the world's ranks), plus tie-breakers small enough not to outweigh
any modelled difference: layouts in ``layouts()`` order (ddp before zero2 before fsdp, so
hidden-equal strategies keep the simpler one), candidates in ``candidates()`` order
(replicate first).

[Note: a tp axis must split a parameter]
Each rank is fed its own rows (see [Note: which mesh axes split the data] in ``plan.py``).
A ``tp`` layout whose ops all replicate would look free here (no collective at all, only
redundant compute), but the runtime must then average gradients over that axis: it is a
``dp`` axis, priced as such by the ``dp`` layouts. So a layout with a tp axis takes at
least one candidate that splits a parameter: ``sum x[L,o,c] >= z[L]`` over those candidates.

[Note: why HiGHS through scipy.optimize.milp]
It solves MILPs exactly (branch and bound to a zero relative gap here), ships inside the
scipy wheel (no solver binary to install or find on PATH, unlike PuLP's CBC) and takes a
sparse matrix directly. The collapsed ILP of one layout has a few hundred to a few thousand
variables and solves in milliseconds ([Note: one ILP per layout]).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np
from scipy.optimize import LinearConstraint, milp
from scipy.sparse import coo_array

from dpar.compiler.costs import DeviceSpec
from dpar.core.plan import Recompute
from dpar.planner.activations import POLICIES, ActivationModel, Blocks, blocks
from dpar.planner.costs import CostModel
from dpar.planner.evaluate import Assignment, chosen
from dpar.planner.layout import Layout
from dpar.planner.opgraph import OpGraph
from dpar.planner.rules import FORWARD_CONVERT, candidates
from dpar.core.errors import OptionsError, PlanMemoryError

TIE_LAYOUT = 1e-4  # per position in layouts(), in units of the ideal step (``ideal_step``)
TIE_CANDIDATE = 1e-6  # per position in candidates()
_SOLVER_SLACK = 1e-7  # relative: HiGHS's optima are feasible to about this, so a bound this close may still tie
GB = 1e9


class _Problem:
    """Variables, objective and sparse rows of the ILP, built up incrementally."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.integral: list[int] = []
        self.upper: list[float] = []
        self.entries: list[tuple[int, int, float]] = []
        self.lower_b: list[float] = []
        self.upper_b: list[float] = []

    def var(self, cost: float, integral: bool, upper: float = 1.0) -> int:
        self.cost.append(cost)
        self.integral.append(int(integral))
        self.upper.append(upper)
        return len(self.cost) - 1

    def row(self, terms: dict[int, float], lower: float, upper: float) -> None:
        r = len(self.lower_b)
        self.entries += [(r, v, c) for v, c in terms.items() if c]
        self.lower_b.append(lower)
        self.upper_b.append(upper)

    def solve(self, cost: dict[int, float] | None = None, rows: int | None = None,
              relaxed: bool = False) -> tuple[np.ndarray, float] | None:
        """The least of the objective (or ``cost``, variable -> coefficient) subject to the first ``rows`` rows (all)
        and where it is reached; ``relaxed``: every variable continuous (a lower bound). None where nothing is
        feasible."""
        rows = len(self.lower_b) if rows is None else rows
        entries = [(r, c, v) for r, c, v in self.entries if r < rows]
        matrix = coo_array(
            ([v for _, _, v in entries], ([r for r, _, _ in entries], [c for _, c, _ in entries])),
            shape=(rows, len(self.cost)),
        ).tocsr()
        objective = np.array(self.cost)
        if cost is not None:
            objective = np.zeros(len(self.cost))
            objective[list(cost)] = list(cost.values())
        result = milp(
            objective,
            integrality=np.zeros(len(self.cost)) if relaxed else np.array(self.integral),
            bounds=(0, np.array(self.upper)),
            constraints=LinearConstraint(matrix, self.lower_b[:rows], self.upper_b[:rows]),
            options={"mip_rel_gap": 0.0, "time_limit": 120.0},
        )
        return (result.x, float(result.fun)) if result.status == 0 else None


@dataclasses.dataclass
class _LayoutProblem:
    """The ILP restricted to one layout (its ``z`` fixed to 1): its memory row (variable -> bytes) and each op's
    candidate variables."""

    layout: Layout
    problem: _Problem
    memory: dict[int, float]
    x: list[list[int]]

    def assignment(self, solution: np.ndarray) -> Assignment:
        return Assignment(self.layout, tuple(int(np.argmax([solution[v] for v in op_vars])) for op_vars in self.x))


def _best(found: list[_LayoutProblem], memory: bool = False) -> tuple[_LayoutProblem, np.ndarray, float] | None:
    """The layout whose problem has the least optimum (of the objective, or with ``memory`` of the memory row,
    without the budget row: the last) and its solution; None where no layout's problem is feasible.

    [Note: one ILP per layout]
    The variables of two layouts meet only in rows that picking one layout (its ``z``) makes trivial, so the ILP over
    every layout is the least of the ILPs over one layout each. Each layout's linear relaxation is solved first, and
    its ILP only while its bound is below the best solution found, cheapest bound first: exact, as the single ILP was.
    Llama-3-70B on 32 x 8 (19 layouts, 106 ops; 2 cores, 2026-12-02): 1.2-3.4 s a policy as one ILP, 0.2-0.4 s so
    (the relaxations were as tight as the ILPs), the search 11.5 s -> 5.5 s, every answer the same.
    """
    def solved(p: _LayoutProblem, relaxed: bool) -> tuple[np.ndarray, float] | None:
        if not memory:
            return p.problem.solve(relaxed=relaxed)
        return p.problem.solve(cost={v: b / GB for v, b in p.memory.items()}, rows=len(p.problem.lower_b) - 1,
                               relaxed=relaxed)

    bounds = []
    for i, p in enumerate(found):
        relaxation = solved(p, True)
        if relaxation is not None:  # an infeasible relaxation: so is the ILP
            bounds.append((relaxation[1], i))
    best: tuple[_LayoutProblem, np.ndarray, float] | None = None
    for bound, i in sorted(bounds):
        if best is not None and bound > best[2] + _SOLVER_SLACK * abs(best[2]):  # within HiGHS's tolerance: solved
            break
        solution = solved(found[i], False)
        if solution is not None and (best is None or solution[1] < best[2]):
            best = (found[i], *solution)
    return best


def ideal_step(graph: OpGraph, layouts: list[Layout], device: DeviceSpec) -> float:
    """The objective's unit: the single device's compute split evenly over the world's ranks, what a step is near
    at any world size, so that the tie-breakers stay small beside a modelled difference (in units of the single
    device's compute, a step at 16,384 ranks is ~1e-4: the layout tie-breaker outweighed 5x step differences)."""
    model = CostModel(graph, Layout((1,), ("dp",), "replicate"), device)
    costs = [model.op_cost(i, candidates(op, 1)[0]) for i, op in enumerate(graph.ops)]
    return (sum(c.compute_fwd + c.compute_bwd for c in costs) or 1.0) / math.prod(layouts[0].mesh_shape)


@dataclasses.dataclass(frozen=True)
class Unfit:
    """No assignment fits the budget under ``recompute``: the least memory per rank one reaches, and where."""

    recompute: Recompute
    least_bytes: float
    layout: Layout


def solve(
    graph: OpGraph, layouts: list[Layout], device: DeviceSpec, memory_budget: float | None,
    recompute: Recompute = Recompute.KEEP,
) -> Assignment:
    """The optimal assignment under one activation policy; ``OptionsError`` when none fits ``memory_budget`` bytes per rank."""
    found = _solve(graph, _cost_models(graph, layouts, device), memory_budget, recompute)
    if isinstance(found, Unfit):
        raise no_fit(found, memory_budget)
    return found


def _cost_models(graph: OpGraph, layouts: list[Layout], device: DeviceSpec) -> list[CostModel]:
    """One cost model a layout, in ``layouts()`` order, shared by every policy's ILP (each op's cost priced once)."""
    return [CostModel(graph, layout, device) for layout in layouts]


def _solve(
    graph: OpGraph, models: list[CostModel], memory_budget: float | None, recompute: Recompute,
) -> Assignment | Unfit:
    found = _build(graph, models, recompute)
    if memory_budget is not None:
        for p in found:
            p.problem.row(p.memory, -math.inf, memory_budget)
        if _lower_bound(graph, models, recompute) > memory_budget:  # no need to search
            return _least(found, recompute)
    best = _best(found)
    if best is None:
        if memory_budget is not None:
            return _least(found, recompute)
        raise OptionsError(f"dpar internal error: the planner's ILP found no solution for {len(models)} layouts")
    p, solution, _ = best
    return p.assignment(solution)


def _least(found: list[_LayoutProblem], recompute: Recompute) -> Unfit:
    """The same ILP minimising memory, without the budget row (the last): the smallest budget that fits."""
    best = _best(found, memory=True)
    if best is None:
        raise OptionsError("dpar internal error: the planner's ILP found no assignment at any memory")
    p, solution, _ = best
    return Unfit(recompute, sum(b * solution[v] for v, b in p.memory.items()), p.layout)


def _build(graph: OpGraph, models: list[CostModel], recompute: Recompute) -> list[_LayoutProblem]:
    """The ILP of [Note: the planner's ILP] under one activation policy, one problem a layout ([Note: one ILP per
    layout])."""
    found = blocks(graph)
    scale = ideal_step(graph, [m.layout for m in models], models[0].device)
    return [_layout_problem(graph, model, rank, recompute, found, scale) for rank, model in enumerate(models)]


def _layout_problem(graph: OpGraph, model: CostModel, rank: int, recompute: Recompute, found: Blocks,
                    scale: float) -> _LayoutProblem:
    """The ILP with ``model``'s layout picked: the ``rank``-th in ``layouts()`` order, for its tie-breaker."""
    layout = model.layout
    problem = _Problem()
    exposed = {phase: problem.var(1.0, False, math.inf) for phase in ("forward", "backward")}
    overlap: dict[str, dict[int, float]] = {phase: {v: 1.0} for phase, v in exposed.items()}
    root: dict[str, dict[int, float]] = {phase: {v: 1.0} for phase, v in exposed.items()}  # [Note: the root bucket is never hidden]
    memory: dict[int, float] = {}
    live = problem.var(0.0, False, math.inf)  # the recomputed block's GB (see [Note: pricing recomputation])
    memory[live] = GB  # in GB, not bytes: a cost of 1e-9 a byte would be below HiGHS's tolerances
    acts = ActivationModel(graph, model, recompute, found)
    critical = model.batch_gather()[1] + model.expert_exchange_seconds() + model.context_exchange_seconds()
    z = problem.var(TIE_LAYOUT * rank + critical / scale, True)
    problem.row({z: 1.0}, 1.0, 1.0)
    for phase, seconds in model.dp_latency().items():
        overlap[phase][z] = -seconds / scale
    for phase, seconds in model.root_latency().items():
        if seconds:
            root[phase][z] = -seconds / scale
    cands = [candidates(op, layout.tp_degree, layout.sequence_parallel) for op in graph.ops]
    x = []
    instance_live: dict[str, dict[int, float]] = defaultdict(dict)
    for o, op_cands in enumerate(cands):
        x.append([])
        for c, cand in enumerate(op_cands):
            cost = model.op_cost(o, cand)
            again = acts.seconds(o, cost)
            v = problem.var(
                (cost.compute_fwd + cost.compute_bwd + again + cost.tp_comm) / scale + TIE_CANDIDATE * c, True
            )
            x[-1].append(v)
            overlap["forward"][v] = -(cost.dp_fwd - cost.compute_fwd) / scale
            overlap["backward"][v] = -(cost.dp_bwd - cost.compute_bwd - again) / scale
            for phase, seconds in (("forward", cost.dp_root_fwd), ("backward", cost.dp_root_bwd)):
                if seconds:
                    root[phase][v] = -seconds / scale
            memory[v] = acts.memory(o, cand, cost)
            if found.of_op[o] is not None and acts.live(o, cand):
                instance_live[found.of_op[o]][v] = acts.live(o, cand)
        problem.row({**{v: 1.0 for v in x[-1]}, z: -1.0}, 0.0, 0.0)
    for terms in instance_live.values():  # live >= each instance's recomputed bytes
        problem.row({live: 1.0, **{v: -b / GB for v, b in terms.items()}}, 0.0, math.inf)
    if layout.tp_degree > 1:  # see [Note: a tp axis must split a parameter]
        splitting = {
            x[o][c]: 1.0 for o, op_cands in enumerate(cands) for c, cand in enumerate(op_cands) if cand.splits_a_parameter
        }
        problem.row({**splitting, z: -1.0}, 0.0, math.inf)
    _edges(problem, graph, model, cands, x, scale, acts, memory)
    _shared(problem, graph, cands, x)
    for phase in exposed:
        problem.row(overlap[phase], 0.0, math.inf)
        problem.row(root[phase], 0.0, math.inf)
    return _LayoutProblem(layout, problem, memory, x)


def policies(graph: OpGraph) -> tuple[Recompute, ...]:
    """The policies worth solving for: without blocks every policy keeps everything."""
    return POLICIES if any(b is not None for b in blocks(graph).of_op) else POLICIES[:1]


def solve_activations(
    graph: OpGraph, layouts: list[Layout], device: DeviceSpec, memory_budget: float | None,
) -> dict[Recompute, Assignment | Unfit]:
    """The optimal assignment under each activation policy, or the least memory it reaches when none fits the budget;
    ``OptionsError`` when no policy fits.

    [Note: choosing the activation policy]
    Placements and policy are chosen together by solving the ILP once per policy (keep,
    selective, full, each with its own saved bytes and recompute time) and keeping the fastest
    that fits (``evaluate`` then prices each the same way, ``api/planning.py`` picks). One ILP
    with a policy variable beside the layout's would be the same optimum; three keep each
    solve as small as today's, and give the report its "why": each policy's best step and
    memory side by side (a policy that cannot fit shows its least memory instead, from the same
    ILP minimising memory; one whose lower bound exceeds the budget skips the search).
    KEEP's fastest assignment is solved first, without the budget: if it fits, it is the answer
    and nothing else is solved (for any one assignment recompute + max(0, comm - compute -
    recompute) >= max(0, comm - compute), so no policy beats it): one ILP, as before.
    """
    models = _cost_models(graph, layouts, device)
    fastest = _solve(graph, models, None, Recompute.KEEP)
    if memory_budget is None or keep_memory(graph, fastest, device) <= memory_budget:
        return {Recompute.KEEP: fastest}
    found: dict[Recompute, Assignment | Unfit] = {}
    for recompute in policies(graph):
        found[recompute] = _solve(graph, models, memory_budget, recompute)
    if all(isinstance(a, Unfit) for a in found.values()):
        raise no_fit(min(found.values(), key=lambda u: u.least_bytes), memory_budget)
    return found


def keep_memory(graph: OpGraph, assignment: Assignment, device: DeviceSpec) -> float:
    """Memory per rank of ``assignment`` keeping every activation."""
    model = CostModel(graph, assignment.layout, device)
    return ActivationModel(graph, model, Recompute.KEEP).total(chosen(graph, assignment))[0]


def _lower_bound(graph: OpGraph, models: list[CostModel], recompute: Recompute) -> float:
    """No assignment under ``recompute`` takes less memory: each op's least-memory candidate, without the live
    block and the kept conversions (which only add)."""
    found, least = blocks(graph), math.inf
    for model in models:
        layout = model.layout
        acts = ActivationModel(graph, model, recompute, found)
        least = min(least, sum(
            min(acts.memory(o, c, model.op_cost(o, c)) for c in candidates(op, layout.tp_degree, layout.sequence_parallel))
            for o, op in enumerate(graph.ops)
        ))
    return least


def smallest_footprint(
    graph: OpGraph, layouts: list[Layout], device: DeviceSpec, recompute: Recompute = Recompute.KEEP,
) -> tuple[float, Layout]:
    """The least memory per rank any assignment reaches under ``recompute`` (the ILP minimising memory), and its layout."""
    found = _build(graph, _cost_models(graph, layouts, device), recompute)
    for p in found:
        p.problem.row({}, 0.0, 0.0)  # stands for the budget row _least leaves out
    least = _least(found, recompute)
    return least.least_bytes, least.layout


def no_fit(unfit: Unfit, budget: float) -> PlanMemoryError:
    """Nothing fits ``budget``: the smallest budget that does, with the policy and layout that reach it."""
    layout = unfit.layout
    mesh = "x".join(map(str, layout.mesh_shape))
    with_policy = "" if unfit.recompute is Recompute.KEEP else f", activation checkpointing {unfit.recompute.value}"
    return PlanMemoryError(
        f"no plan fits memory_budget_gb={budget / 1e9:.3g}: the smallest footprint found is "
        f"{unfit.least_bytes / 1e9:.4g} GB per rank ({layout.strategy} on mesh {mesh}, roles "
        f"{'/'.join(layout.roles)}{with_policy}); raise memory_budget_gb to at least that, or plan for more ranks "
        "(a bigger mesh_shape) so that sharding divides the state further"
    )


def _edges(
    problem: _Problem, graph: OpGraph, model: CostModel, cands: list, x: list[list[int]], scale: float,
    acts: ActivationModel, memory: dict[int, float],
) -> None:
    """Forward resharding per edge (its result's bytes when a recomputed op reads it: ``memory``); backward per
    producer and gradient placement (see the Note)."""
    pairs: dict[int, dict[tuple[int, int], int]] = {}
    converted: dict[tuple[int, int, str], list[int]] = defaultdict(list)  # (producer, its candidate, wanted) -> pairs
    for i, e in enumerate(graph.edges):
        src, dst = cands[e.src], cands[e.dst]
        pair: dict[tuple[int, int], int] = {}
        if len(src) == 1:
            pair = {(0, c2): x[e.dst][c2] for c2 in range(len(dst))}
        elif len(dst) == 1:
            pair = {(c1, 0): x[e.src][c1] for c1 in range(len(src))}
        else:
            pair = {(c1, c2): problem.var(0.0, False) for c1 in range(len(src)) for c2 in range(len(dst))}
            for c1 in range(len(src)):
                problem.row({**{pair[c1, c2]: 1.0 for c2 in range(len(dst))}, x[e.src][c1]: -1.0}, 0.0, 0.0)
            for c2 in range(len(dst)):
                problem.row({**{pair[c1, c2]: 1.0 for c1 in range(len(src))}, x[e.dst][c2]: -1.0}, 0.0, 0.0)
        for (c1, c2), v in pair.items():
            wanted = dst[c2].inputs[e.position]
            if FORWARD_CONVERT.get((src[c1].output, wanted)) is not None:
                converted[e.src, c1, wanted].append(v)
            kept = acts.converted(e, src[c1], dst[c2])
            if kept:
                memory[v] = memory.get(v, 0.0) + kept
        pairs[i] = pair
    for (u, c1, wanted), readers in converted.items():  # one conversion serves every reader wanting it so
        _, seconds = model.convert_forward(u, cands[u][c1], wanted)
        if seconds:
            once = problem.var(seconds / scale, False)
            for v in readers:
                problem.row({once: 1.0, v: -1.0}, 0.0, math.inf)
    out_edges: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(graph.edges):
        out_edges[e.src].append(i)
    for u, edges in out_edges.items():
        for c1, cand in enumerate(cands[u]):
            for arriving in ("R", "S", "P", "Q"):
                _, seconds = model.backward_convert(u, arriving, cand.output_grad)
                if not seconds:
                    continue
                a = problem.var(seconds / scale, False)
                for i in edges:
                    e = graph.edges[i]
                    terms = {
                        v: -1.0
                        for (s1, c2), v in pairs[i].items()
                        if s1 == c1 and cands[e.dst][c2].input_grads[e.position] == arriving
                    }
                    if terms:
                        problem.row({a: 1.0, **terms}, 0.0, math.inf)


def _shared(problem: _Problem, graph: OpGraph, cands: list, x: list[list[int]]) -> None:
    """A parameter read by two ops is placed alike by both."""
    for a, sa, b, sb in graph.shared:
        placements = {c.params[sa] for c in cands[a]} | {c.params[sb] for c in cands[b]}
        for placement in sorted(placements):
            terms = {x[a][c]: 1.0 for c, cand in enumerate(cands[a]) if cand.params[sa] == placement}
            terms.update({x[b][c]: -1.0 for c, cand in enumerate(cands[b]) if cand.params[sb] == placement})
            problem.row(terms, 0.0, 0.0)
