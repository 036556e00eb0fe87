"""Price one assignment (a layout and a candidate per op) and write it out as a Plan.

The ILP's solution and every hand-written strategy go through here, so the planner's
optimum and the strategies it is compared with are priced by the same code.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from dpar.compiler.costs import DeviceSpec
from dpar.planner.costs import CostModel, OpCost
from dpar.planner.layout import Layout
from dpar.planner.opgraph import OpGraph
from dpar.planner.plan import CollectivePlan, CostBreakdown, OpPlan, ParameterPlan, Plan
from dpar.planner.rules import Candidate, candidates
from dpar.core.errors import OptionsError


@dataclasses.dataclass(frozen=True)
class Assignment:
    layout: Layout
    choices: tuple[int, ...]  # index into candidates(op, tp degree) per op of the graph


def chosen(graph: OpGraph, assignment: Assignment) -> list[Candidate]:
    tp, sp = assignment.layout.tp_degree, assignment.layout.sequence_parallel
    picked = [candidates(op, tp, sp)[c] for op, c in zip(graph.ops, assignment.choices)]
    for a, sa, b, sb in graph.shared:
        if picked[a].params[sa] != picked[b].params[sb]:
            raise OptionsError(
                f"{graph.ops[a].params[sa]} is read by {graph.ops[a].name} ({picked[a].name}) and {graph.ops[b].name} "
                f"({picked[b].name}), which place it {picked[a].params[sa]} and {picked[b].params[sb]}; a tied "
                "parameter needs one placement"
            )
    return picked


def backward_arrivals(graph: OpGraph, picked: list[Candidate]) -> dict[int, set[str]]:
    """Per producer, the placements its output's gradients arrive in (summed per placement first)."""
    arriving: dict[int, set[str]] = defaultdict(set)
    for e in graph.edges:
        arriving[e.src].add(picked[e.dst].input_grads[e.position])
    return arriving


def evaluate(graph: OpGraph, assignment: Assignment, device: DeviceSpec) -> Plan:
    layout = assignment.layout
    model = CostModel(graph, layout, device)
    picked = chosen(graph, assignment)
    costs = [model.op_cost(i, c) for i, c in enumerate(picked)]
    total = OpCost(*(sum(getattr(c, f.name) for c in costs) for f in dataclasses.fields(OpCost)))
    collectives: list[CollectivePlan] = []
    tp_comm = total.tp_comm
    batch_bytes, seconds = model.batch_gather()
    if batch_bytes:
        tp_comm += seconds
        collectives.append(_tp("all_gather", "forward", batch_bytes, 1, "the batch: the tp group's slices"))
    readers: dict[tuple[int, str], list[str]] = defaultdict(list)  # (producer, placement wanted) -> its readers
    for e in graph.edges:
        readers[e.src, picked[e.dst].inputs[e.position]].append(graph.ops[e.dst].name)
    for (u, wanted), names in readers.items():
        kind, seconds = model.convert_forward(u, picked[u], wanted)
        if kind:
            tp_comm += seconds
            src = graph.ops[u]
            nbytes = model.activation_bytes(src.output_numel, src.batched, "R", src.output_itemsize)
            collectives.append(_tp(kind, "forward", nbytes, src.count, f"{src.name} -> {', '.join(names)}"))
    for src, placements in backward_arrivals(graph, picked).items():
        for arriving in sorted(placements):
            kind, seconds = model.backward_convert(src, arriving, picked[src].output_grad)
            if kind:
                tp_comm += seconds
                op = graph.ops[src]
                nbytes = model.activation_bytes(op.output_numel, op.batched, "R", op.output_itemsize)
                collectives.append(_tp(kind, "backward", nbytes, op.count, f"gradient of {op.name}"))
    for o, (op, cand) in enumerate(zip(graph.ops, picked)):
        if cand.stats and layout.tp_degree > 1:
            collectives.append(_tp("all_reduce", "forward", model.stats_bytes(op), cand.stats * op.count, op.name))
        sizes, _ = model.sequence_parallel_gradients(o, cand)
        if sizes:
            collectives.append(CollectivePlan("all_reduce", "tp", "backward", round(sum(sizes)), len(sizes),
                                              f"{op.name}: its weights' gradients (sequence parallel)"))
    collectives += _dp_collectives(graph, model, picked)
    over = "tp" if model.tp_experts else "ep"  # the spread experts' reductions are tp's; the exchange ep's
    for kind, phase, nbytes, count, where in model.expert_exchange():
        collectives.append(CollectivePlan(kind, over, phase, round(nbytes * count), count, where))
    ep_comm = model.expert_exchange_seconds()
    if model.tp_experts:
        tp_comm, ep_comm = tp_comm + ep_comm, 0.0
    for kind, phase, nbytes, count, where in model.context_exchange():
        collectives.append(CollectivePlan(kind, "cp", phase, round(nbytes * count), count, where))
    cp_comm = model.context_exchange_seconds()
    latency = model.dp_latency()
    dp_fwd, dp_bwd = total.dp_fwd + latency["forward"], total.dp_bwd + latency["backward"]
    exposed = tp_comm + ep_comm + cp_comm + model.exposed_dp(costs)
    compute = total.compute_fwd + total.compute_bwd
    activations = sum(op.count * model.saved_bytes(i, c) for i, (op, c) in enumerate(zip(graph.ops, picked)) if op.kind != "output")
    cost = CostBreakdown(
        compute_s=compute,
        comm_s=tp_comm + ep_comm + cp_comm + dp_fwd + dp_bwd,
        exposed_comm_s=exposed,
        step_s=compute + exposed,
        memory_bytes_per_rank=round(total.memory),
        tp_comm_s=tp_comm,
        dp_comm_s=dp_fwd + dp_bwd,
        ep_comm_s=ep_comm,
        cp_comm_s=cp_comm,
        activation_bytes_per_rank=round(activations),
    )
    return Plan(
        mesh_shape=layout.mesh_shape,
        mesh_dim_names=tuple(layout.roles),
        data_parallel=layout.data_parallel,
        strategy=layout.strategy,
        sequence_parallel=layout.sequence_parallel,
        attention_exchange=model.attention_exchange,
        parameters=_parameters(graph, model, picked),
        cost=cost,
        batch_size=graph.batch_size,
        same_batch_in_cp_group=layout.cp_degree > 1 and graph.batch_size % layout.token_degree != 0,
        collectives=tuple(collectives),
        ops=tuple(OpPlan(op.name, op.module, op.kind, c.name, op.count) for op, c in zip(graph.ops, picked)),
    )


def _tp(kind: str, phase: str, nbytes: float, count: int, where: str) -> CollectivePlan:
    return CollectivePlan(kind, "tp", phase, round(nbytes * count), count, where)


def _dp_collectives(graph: OpGraph, model: CostModel, picked: list[Candidate]) -> list[CollectivePlan]:
    """One entry per kind and phase: ``count`` buckets moving ``bytes`` between them (under ep the experts' apart,
    over ``dp``)."""
    found = []
    for expert in (False, True):
        if not model.reduced_over(expert) or (expert and not model.experts):
            continue
        for kind, phase, trained_only, not_root, buckets in model.dp_collectives():
            nbytes = sum(
                model.param_numel(p, picked[p.op].params[p.slot]) * p.itemsize
                for p in graph.params
                if p.op is not None and (p.name in model.experts) is expert and (p.requires_grad or not trained_only)
                and not (not_root and p.bucket == "root")
            )
            where = ("in buckets of DDP's cap, gradient order" if model.layout.data_parallel == "replicate" else
                     "one per bucket (numbered block)" if not_root else "one per bucket (numbered block, root)")
            if expert:
                buckets, where = model.expert_buckets[trained_only, not_root], f"the experts': {where}"
            found.append(CollectivePlan(kind, "dp" if expert or not model.experts else "dp x ep", phase, round(nbytes),
                                        buckets, where))
    if model.layout.cp_axis is not None:  # the gradients' partial sums over the sequence (see the cost model's Note)
        trained = [p for p in graph.params if p.op is not None and p.requires_grad]
        nbytes = sum(model.param_numel(p, picked[p.op].params[p.slot]) * p.itemsize for p in trained)
        found.append(CollectivePlan("all_reduce", "cp", "backward", round(nbytes), model.context_gradient_buckets(),
                                    "the gradients (partial sums over the sequence), in buckets"))
    return found


def _parameters(graph: OpGraph, model: CostModel, picked: list[Candidate]) -> tuple[ParameterPlan, ...]:
    layout = model.layout
    found = []
    for info in graph.params:
        tp_placement = model.tp_placement(info, "R" if info.op is None else picked[info.op].params[info.slot])
        expert = info.name in model.experts
        placements = tuple(
            (tp_placement if role == "tp" else "S(0)" if role == "ep" and expert else layout.dp_placement) if n > 1 else "R"
            for role, n in zip(layout.roles, layout.mesh_shape)
        )
        numel = model.param_numel(info, tp_placement)
        found.append(
            ParameterPlan(
                name=info.name,
                shape=info.shape,
                placements=placements,
                comm_bytes=round(model.param_moved_bytes(info, tp_placement)),
                memory_bytes=round(model.param_state_bytes(numel, info.requires_grad, info.itemsize, expert)),
            )
        )
    return tuple(found)

