"""The named strategies written by hand, priced by the planner's own cost model.

``ddp``/``zero2``/``fsdp`` make every mesh dimension data parallel and replicate every op on
it. ``tp`` is Megatron-LM on a 1-D mesh: a Linear whose input arrives sharded is a row
Linear, any other a column Linear (so column -> row pairs with the heads split between
them), the embedding is vocab-parallel and the tied LM head a column Linear over the vocab,
and every other op takes the candidate that needs the least resharding of its inputs.
``<dp>+tp`` on a 2-D mesh: data parallel on dimension 0, Megatron on dimension 1. ``ep`` on a
1-D mesh and ``<dp>+ep`` on a 2-D one: the routed experts split over the last dimension, the
rest data parallel over all (planner/layout.py), for a model with routed experts. ``cp`` on a 1-D mesh
and ``<dp>+cp`` on a 2-D one: each sequence split over the last dimension (planner/layout.py), for a
model with attention.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from dpar.compiler.costs import DeviceSpec
from dpar.planner.evaluate import Assignment, evaluate
from dpar.planner.layout import Layout, layouts
from dpar.planner.opgraph import OpGraph
from dpar.planner.plan import Plan, PolicyOption
from dpar.planner.rules import FORWARD_CONVERT, Candidate, candidates
from dpar.core.errors import OptionsError
from dpar.core.plan import AxisRole, Strategy
from dpar.planner.layout import MODES

# The named strategies the planner prices: at most one data axis beside a tensor, an expert or a context axis, doing
# a mode it knows (a context and a tensor axis together are searched on a mesh given in three dimensions, not priced
# here as a named strategy: a 2-D mesh names one role per dimension).
STRATEGIES = tuple(
    s.value for s in Strategy
    if s.data_parallel in (None, *MODES.values())
    and sum(r not in (AxisRole.TENSOR, AxisRole.EXPERT, AxisRole.CONTEXT) for r in s.roles) <= 1
    and not (s.context_parallel and s.tensor_parallel)
)
LAYOUT_MODE = {mode: name for name, mode in MODES.items()}
PREFERRED = {"embedding": ("vocab",)}  # a Linear is column or row by what arrives


def strategy_layout(name: str, mesh_shape: tuple[int, ...]) -> Layout:
    if name not in STRATEGIES:
        raise OptionsError(f"unknown strategy {name!r}; the named strategies are {', '.join(STRATEGIES)}")
    strategy = Strategy(name)
    mode = LAYOUT_MODE.get(strategy.data_parallel, "replicate")  # tp alone: no data axis, replicated over none
    if strategy.expert_parallel or strategy.context_parallel:
        roles = strategy.mesh_dim_names
        if len(mesh_shape) != len(roles):
            raise OptionsError(f"strategy {name!r} takes a {len(roles)}-D mesh {roles}, not {mesh_shape}")
        return Layout(tuple(mesh_shape), roles, mode)
    if strategy.data_parallel is None:
        if len(mesh_shape) != 1:
            raise OptionsError(f"strategy 'tp' takes a 1-D mesh, not {mesh_shape}; use 'ddp+tp' or 'fsdp+tp' on 2-D")
        return Layout(tuple(mesh_shape), ("tp",), mode)
    if strategy.tensor_parallel:
        if len(mesh_shape) != 2:
            raise OptionsError(f"strategy {name!r} takes a 2-D mesh (dp, tp), not {mesh_shape}")
        return Layout(tuple(mesh_shape), ("dp", "tp"), mode)
    return Layout(tuple(mesh_shape), ("dp",) * len(mesh_shape), mode)


def megatron(graph: OpGraph, tp: int, sequence_parallel: bool = False) -> tuple[int, ...]:
    """Candidate per op for Megatron tensor parallel (see the module docstring); with ``sequence_parallel``
    Megatron-SP: every token-wise op that can takes the token split."""
    picked: list[Candidate | None] = [None] * len(graph.ops)
    partners: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for a, sa, b, sb in graph.shared:
        partners[a, sa].append((b, sb))
        partners[b, sb].append((a, sa))

    def consistent(o: int, cand: Candidate) -> bool:  # with the already placed readers of a tied parameter
        return all(
            picked[b] is None or picked[b].params[sb] == cand.params[s]
            for s in range(len(cand.params)) for b, sb in partners[o, s]
        )

    choices = []
    for o, op in enumerate(graph.ops):
        arriving = [picked[u].output if u >= 0 and picked[u] is not None else "R" for u in op.inputs]
        options = [(c, cand) for c, cand in enumerate(candidates(op, tp, sequence_parallel)) if consistent(o, cand)]
        wanted = (("row",) if arriving[0] == "S" else ("column",)) if op.kind == "linear" else PREFERRED.get(op.kind, ())
        matching = [(c, cand) for c, cand in options if cand.name in wanted]
        tied = any(partners[o, s] for s in range(len(op.params)))
        if wanted and not matching and not tied:
            dims = {"column": "out_features", "row": "in_features", "vocab": "num_embeddings"}
            raise OptionsError(
                f"strategy 'tp': tp degree {tp} does not divide the {dims[wanted[0]]} of {op.module or op.name} "
                f"(weight {op.param_shapes[0]}); use a tp degree that divides it"
            )
        c, cand = matching[0] if matching else min(  # the fewest conversions; of as few, the token split
            options, key=lambda t: (sum(FORWARD_CONVERT.get((a, r)) is not None for a, r in zip(arriving, t[1].inputs)),
                                    t[1].name != "sequence")
        )
        picked[o] = cand
        choices.append(c)
    return tuple(choices)


def strategy_assignment(graph: OpGraph, name: str, mesh_shape: tuple[int, ...]) -> Assignment:
    layout = strategy_layout(name, mesh_shape)
    counts = [info.num_experts for info in graph.experts]
    if layout.ep_axis is not None and (not counts or any(n % layout.ep_degree for n in counts)):
        raise OptionsError(f"strategy {name!r}: the model has no routed experts that {layout.ep_degree} ranks divide "
                           f"(experts per module: {sorted(set(counts))})")
    if layout.cp_axis is not None and not layouts(layout.mesh_shape, layout.roles, sequence_length=graph.sequence_length):
        raise OptionsError(f"strategy {name!r}: the model has no attention over a sequence of a length 2 x "
                           f"{layout.cp_degree} divides (sequence: {graph.sequence_length or 'none'})")
    if graph.batch_size % layout.dp_degree:
        raise OptionsError(f"strategy {name!r}: batch {graph.batch_size} is not divisible by the dp degree {layout.dp_degree}")
    if layout.tp_degree == 1:
        return Assignment(layout, (0,) * len(graph.ops))
    return Assignment(layout, megatron(graph, layout.tp_degree))


def compare_strategies(
    graph: OpGraph, mesh_shape: tuple[int, ...], device: DeviceSpec, budget: float | None,
) -> tuple[PolicyOption, ...]:
    """Each named strategy that applies to ``mesh_shape`` (a tp one with and without sequence parallel) under its
    fastest uniform activation policy that fits ``budget`` (the least memory where none does), priced as the search
    prices: the hand-written layouts a plan is shown beside."""
    from dpar.planner.activations import with_policy
    from dpar.planner.solver import policies

    found = []
    for name in STRATEGIES:
        try:
            assignment = strategy_assignment(graph, name, mesh_shape)
        except OptionsError:
            continue
        layout = assignment.layout
        variants = [assignment] + ([Assignment(dataclasses.replace(layout, sequence_parallel=True),
                                               megatron(graph, layout.tp_degree, sequence_parallel=True))]
                                   if layout.tp_degree > 1 else [])
        for variant in variants:
            base = evaluate(graph, variant, device)
            priced = [(r, with_policy(base, graph, variant, device, r)) for r in policies(graph)]
            fitting = [(r, p) for r, p in priced if budget is None or p.cost.memory_bytes_per_rank <= budget]
            r, p = (min(fitting, key=lambda t: t[1].cost.step_s) if fitting
                    else min(priced, key=lambda t: t[1].cost.memory_bytes_per_rank))
            label = name + (" (sequence parallel)" if variant.layout.sequence_parallel else "")
            found.append(PolicyOption(r.value, label, p.cost.step_s, p.cost.recompute_s, p.cost.memory_bytes_per_rank,
                                      bool(fitting)))
    return tuple(found)


def evaluate_strategies(graph: OpGraph, mesh_shape: tuple[int, ...], device: DeviceSpec) -> dict[str, Plan | str]:
    """Every named strategy that applies to ``mesh_shape``: its plan, or why it does not apply."""
    found: dict[str, Plan | str] = {}
    for name in STRATEGIES:
        try:
            found[name] = evaluate(graph, strategy_assignment(graph, name, mesh_shape), device)
        except OptionsError as error:
            found[name] = str(error)
    return found
