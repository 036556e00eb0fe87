"""The ILP: one layout for the model, one candidate per op, priced by the cost model, solved exactly.

[Note: the planner's ILP]
Binary ``z[L]`` picks the layout L (mesh roles and data-parallel mode), binary ``x[L,o,c]``
the candidate c of op o under L, with ``sum_c x[L,o,c] = z[L]``. Resharding on an edge
u -> v depends on both ends, so it is priced on product variables ``y[e,c1,c2]`` linearised
by ``sum_c2 y = x[u,c1]`` and ``sum_c1 y = x[v,c2]`` (with one-hot x this forces y to the
product; y is continuous). Gradients of a tensor read by several ops are summed per
placement before one conversion, so ``a[u,c1,q] >= sum of y`` over consumers that hand back
a gradient in placement q, for each consumer. The data-parallel overlap is
``e_phase >= dp_comm_phase - compute_phase``, e >= 0. A parameter read by two ops (tied
embedding and LM head) gets equal placements from both. The memory budget is one row.

Objective: compute + tp comm (a tp layout's batch gather priced on z[L]) + exposed dp comm,
in units of the single-device compute time, plus tie-breakers small enough not to outweigh
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
sparse matrix directly. The collapsed ILP has a few thousand variables and solves in
milliseconds to a fraction of a second.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
from scipy.optimize import LinearConstraint, milp
from scipy.sparse import coo_array

from dpar.compiler.costs import DeviceSpec
from dpar.core.plan import Recompute
from dpar.planner.activations import POLICIES, ActivationModel, Blocks, blocks
from dpar.planner.costs import CostModel
from dpar.planner.evaluate import Assignment
from dpar.planner.layout import Layout
from dpar.planner.opgraph import OpGraph
from dpar.planner.rules import candidates
from dpar.core.errors import OptionsError

TIE_LAYOUT = 1e-4  # per position in layouts(), in units of single-device compute
TIE_CANDIDATE = 1e-6  # per position in candidates()


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

    def solve(self) -> np.ndarray | None:
        rows, cols, vals = zip(*self.entries)
        matrix = coo_array((vals, (rows, cols)), shape=(len(self.lower_b), len(self.cost))).tocsr()
        result = milp(
            np.array(self.cost),
            integrality=np.array(self.integral),
            bounds=(0, np.array(self.upper)),
            constraints=LinearConstraint(matrix, self.lower_b, self.upper_b),
            options={"mip_rel_gap": 0.0, "time_limit": 120.0},
        )
        return result.x if result.status == 0 else None


def single_device_compute(graph: OpGraph, device: DeviceSpec) -> float:
    model = CostModel(graph, Layout((1,), ("dp",), "replicate"), device)
    costs = [model.op_cost(i, candidates(op, 1)[0]) for i, op in enumerate(graph.ops)]
    return sum(c.compute_fwd + c.compute_bwd for c in costs) or 1.0


def solve(
    graph: OpGraph, layouts: list[Layout], device: DeviceSpec, memory_budget: float | None,
    recompute: Recompute = Recompute.KEEP,
) -> Assignment:
    """The optimal assignment under one activation policy; ``OptionsError`` when none fits ``memory_budget`` bytes per rank."""
    found = blocks(graph)
    if memory_budget is not None and smallest_footprint(graph, layouts, device, recompute, found)[0] > memory_budget:
        raise no_fit(graph, layouts, device, memory_budget, recompute)
    scale = single_device_compute(graph, device)
    problem = _Problem()
    exposed = {phase: problem.var(1.0, False, math.inf) for phase in ("forward", "backward")}
    overlap: dict[str, dict[int, float]] = {phase: {v: 1.0} for phase, v in exposed.items()}
    memory: dict[int, float] = {}
    live = problem.var(0.0, False, math.inf)  # the recomputed block's bytes (see [Note: pricing recomputation])
    memory[live] = 1.0
    chosen: dict[Layout, tuple[int, list[list[int]]]] = {}
    for rank, layout in enumerate(layouts):
        model = CostModel(graph, layout, device)
        acts = ActivationModel(graph, model, recompute, found)
        z = problem.var(TIE_LAYOUT * rank + model.batch_gather()[1] / scale, True)
        for phase, seconds in model.dp_latency().items():
            overlap[phase][z] = -seconds / scale
        cands = [candidates(op, layout.tp_degree) for op in graph.ops]
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
                memory[v] = acts.memory(o, cand, cost)
                if found.of_op[o] is not None and acts.live(o, cand):
                    instance_live[found.of_op[o]][v] = acts.live(o, cand)
            problem.row({**{v: 1.0 for v in x[-1]}, z: -1.0}, 0.0, 0.0)
        for terms in instance_live.values():  # live >= each instance's recomputed bytes
            problem.row({live: 1.0, **{v: -b for v, b in terms.items()}}, 0.0, math.inf)
        if layout.tp_degree > 1:  # see [Note: a tp axis must split a parameter]
            splitting = {
                x[o][c]: 1.0 for o, op_cands in enumerate(cands) for c, cand in enumerate(op_cands) if cand.splits_a_parameter
            }
            problem.row({**splitting, z: -1.0}, 0.0, math.inf)
        _edges(problem, graph, model, cands, x, scale, acts)
        _shared(problem, graph, cands, x)
        chosen[layout] = (z, x)
    problem.row({z: 1.0 for z, _ in chosen.values()}, 1.0, 1.0)
    for phase in exposed:
        problem.row(overlap[phase], 0.0, math.inf)
    if memory_budget is not None:
        problem.row(memory, -math.inf, memory_budget)
    solution = problem.solve()
    if solution is None:
        if memory_budget is not None:
            raise no_fit(graph, layouts, device, memory_budget, recompute)
        raise OptionsError(f"dpar internal error: the planner's ILP found no solution for {len(layouts)} layouts")
    for layout, (z, x) in chosen.items():
        if solution[z] > 0.5:
            return Assignment(layout, tuple(int(np.argmax([solution[v] for v in op_vars])) for op_vars in x))
    raise AssertionError("one layout is always chosen")


def policies(graph: OpGraph) -> tuple[Recompute, ...]:
    """The policies worth solving for: without blocks every policy keeps everything."""
    return POLICIES if any(b is not None for b in blocks(graph).of_op) else POLICIES[:1]


def solve_activations(
    graph: OpGraph, layouts: list[Layout], device: DeviceSpec, memory_budget: float | None,
) -> dict[Recompute, Assignment | OptionsError]:
    """The optimal assignment under each activation policy (or why none fits); ``OptionsError`` when none does.

    [Note: choosing the activation policy]
    Placements and policy are chosen together by solving the ILP once per policy (keep,
    selective, full, each with its own saved bytes and recompute time) and keeping the fastest
    that fits (``evaluate`` then prices each the same way, ``api/planning.py`` picks). One ILP
    with a policy variable beside the layout's would be the same optimum; three keep each
    solve as small as today's, and give the report its "why": each policy's best step and
    memory side by side. A policy whose smallest footprint exceeds the budget is not solved.
    Without a budget KEEP is the answer (for any one assignment it is never slower), so the
    others are solved only to be shown when a budget rules placements out.
    """
    found: dict[Recompute, Assignment | OptionsError] = {}
    for recompute in policies(graph):
        try:
            found[recompute] = solve(graph, layouts, device, memory_budget, recompute)
        except OptionsError as error:
            found[recompute] = error
        if memory_budget is None:
            break
    if all(isinstance(a, OptionsError) for a in found.values()):
        raise no_fit(graph, layouts, device, memory_budget, list(found)[-1])  # the policy that recomputes most
    return found


def _argmin_assignment(graph: OpGraph, layout: Layout, device: DeviceSpec, recompute: Recompute, found: Blocks) -> float:
    """Memory of the assignment that takes each op's least-memory candidate (ties: the least recomputed bytes)."""
    model = CostModel(graph, layout, device)
    acts = ActivationModel(graph, model, recompute, found)
    picked, total = [], 0.0
    for o, op in enumerate(graph.ops):
        priced = [(acts.memory(o, c, model.op_cost(o, c)), acts.live(o, c), c) for c in candidates(op, layout.tp_degree)]
        memory, _, cand = min(priced, key=lambda t: (t[0], t[1]))
        picked.append(cand)
        total += memory
    return total + acts.peak(picked)


def smallest_footprint(
    graph: OpGraph, layouts: list[Layout], device: DeviceSpec, recompute: Recompute = Recompute.KEEP,
    found: Blocks | None = None,
) -> tuple[float, Layout]:
    """The least memory per rank found under ``recompute`` (memory does not depend on the edges): for each layout,
    the assignment of each op's least-memory candidate."""
    found = found or blocks(graph)
    return min(((_argmin_assignment(graph, layout, device, recompute, found), layout) for layout in layouts),
               key=lambda t: t[0])


def no_fit(
    graph: OpGraph, layouts: list[Layout], device: DeviceSpec, budget: float, recompute: Recompute = Recompute.KEEP,
) -> OptionsError:
    """Why nothing fits under ``recompute``: the smallest footprint found with it."""
    footprint, layout = smallest_footprint(graph, layouts, device, recompute)
    mesh = "x".join(map(str, layout.mesh_shape))
    with_policy = "" if recompute is Recompute.KEEP else f", activation checkpointing {recompute.value}"
    return OptionsError(
        f"no plan fits memory_budget_gb={budget / 1e9:.3g}: the smallest footprint found is {footprint / 1e9:.3g} GB "
        f"per rank ({layout.strategy} on mesh {mesh}, roles {'/'.join(layout.roles)}{with_policy}); raise "
        "memory_budget_gb to at least that, or plan for more ranks (a bigger mesh_shape) so that sharding divides the "
        "state further"
    )


def _edges(
    problem: _Problem, graph: OpGraph, model: CostModel, cands: list, x: list[list[int]], scale: float,
    acts: ActivationModel,
) -> None:
    """Forward resharding per edge (twice when recomputed); backward per producer and gradient placement (see the Note)."""
    pairs: dict[int, dict[tuple[int, int], int]] = {}
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
        again = 2.0 if acts.edge_repeats(e.dst) else 1.0
        for (c1, c2), v in pair.items():
            _, seconds = model.edge_forward(e, src[c1], dst[c2])
            if seconds:
                problem.cost[v] += again * seconds / scale
        pairs[i] = pair
    out_edges: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(graph.edges):
        out_edges[e.src].append(i)
    for u, edges in out_edges.items():
        for c1, cand in enumerate(cands[u]):
            for arriving in ("R", "S", "P"):
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
