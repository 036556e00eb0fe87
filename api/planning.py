"""``dpar.plan``: capture the model on fake tensors, price every layout and candidate, solve the ILP.

See ``docs/planner.md`` and the Notes in ``planner/`` (the cost model, the ILP,
repeated blocks).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from dpar.planner.capture import build_op_graph
from dpar.planner.evaluate import Assignment, evaluate
from dpar.compiler.costs import DeviceSpec, device_spec
from dpar.planner.layout import ROLES, Layout, layouts
from dpar.planner.opgraph import OpGraph
from dpar.planner.activations import POLICIES
from dpar.planner.pipeline import PipelineCandidate, PipelinePlan
from dpar.graph_pricing import count_on_graphs, priced_on_graphs
from dpar.side_processes import SideProcesses
from dpar.planner.plan import CostBreakdown, ParameterPlan, Plan, PolicyOption, policy_label
from dpar.planner.rules import candidates
from dpar.planner.strategies import compare_strategies
from dpar.compiler.memory import OPTIMIZER_STATES
from dpar.core.errors import OptionsError, PipelineMemoryError, PlanMemoryError
from dpar.core.plan import ActivationPolicy, Recompute
from dpar.core.torch_internals import pytree

__all__ = ["CostBreakdown", "DeviceSpec", "ParameterPlan", "Plan", "global_batch", "plan", "priced_on_graphs"]


def plan(
    model: nn.Module,
    example_inputs: Sequence[object] | torch.Tensor,
    *,
    mesh_shape: int | Sequence[int],
    memory_budget_gb: float | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    device: str | DeviceSpec = "h100",
    on_graphs: bool = False,
    pipelines: bool | None = None,
) -> Plan:
    """The cheapest plan for ``model`` on ``mesh_shape`` ranks that fits ``memory_budget_gb`` per rank (by default
    the device's memory: 80 GB on ``"h100"``, 141 on ``"h200"``; none on ``"cpu"``).

    Placements and activation checkpointing are chosen together: when keeping every activation does
    not fit at the fastest placements, each policy (``keep``, ``selective``: recompute the cheap ops
    between matmuls, ``full``: recompute each block) is solved for and the fastest that fits wins
    (``plan.activations``, which ``parallelize(plan=...)`` applies; ``print(plan)`` shows each
    policy's best, the memory before and after and the recompute time added). A budget nothing
    reaches, even recomputing every block, is an ``OptionsError`` naming the smallest that fits.

    ``example_inputs`` is the **global** batch: the rows of one training step over all ranks,
    which the plan's data-parallel axes split (``print(plan)`` names them). Every plan is
    priced at that same batch. This is not what one rank is fed: under DDP's data contract
    each rank gets its own slice, and ``parallelize(strategy="auto", example_inputs=...)``
    takes that slice and plans for it times the world size (``global_batch``). Real, fake or
    meta tensors all work, and the model may live on the meta device.
    ``mesh_dim_names`` fixes each dimension's role (``"dp"`` or ``"tp"``) instead of letting
    the solver choose. ``device`` is a preset (``"h100"``, ``"h200"``, ``"cpu"``) or a ``DeviceSpec``:
    the one device description ``dpar inspect`` prices with too (``dpar.compiler.costs``); a preset's
    last mesh dimension is node-local (NVLink) when it fits in a node, the others cross nodes.
    ``on_graphs``: the chosen plan priced by ``dpar inspect`` itself (compute, recomputation, the simulated step,
    the memory at the step's peak), at the price of compiling its step for the mesh's ranks on a meta copy
    (``dpar plan`` does it unless ``--op-graph``; a plan with a tp or cp axis on copies cut to a few blocks): see the
    Notes in api/graph_pricing.py, [Note: the planner searches on its op graph and reports as inspect] first. By
    default the search's own (op-graph) figures. The pipeline search and each compiled copy run in forked processes
    beside the caller's, as many at once as cores and one more, where that is safe (``plan.beside`` lists them and
    their times): [Note: planning work in processes beside the caller's].
    ``pipelines`` (unless ``mesh_dim_names`` fixes the roles): the pipeline search (``dpar.planner.plan_pipeline``:
    pp x tp x dp, the schedule 1F1B, ZB-H1 or ZBV, each block's policy) runs too, on the same ranks, batch, budget
    and device, and the plan is the faster of the two searches' answers: see [Note: one answer over placements and
    pipelines]. A pipeline answer has ``plan.pipeline`` set (its mesh ``("dp", "pp", "tp")``); ``dpar.pipeline(model, loss_fn,
    example_inputs=..., plan=plan)`` runs it, ``parallelize`` refuses it by name. ``None`` (the default): searched
    on a GPU preset, not for processes on a CPU's cores nor on links given per mesh dimension (the Note says why);
    ``False``: placements only (what ``parallelize(strategy="auto")`` applies when the answer is a pipeline).
    """
    from dpar.planner.solver import solve_activations  # scipy.optimize: loaded when planning, not on import dpar

    shape = _mesh_shape(mesh_shape)
    names = _mesh_dim_names(mesh_dim_names, shape)
    device = device_spec(device)
    device.links(shape)  # refuses hand-given links that do not match the mesh, before capturing
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    budget = device.memory_bytes if memory_budget_gb is None else memory_budget_gb * 1e9
    if pipelines is None:  # see the Note
        pipelines = device.cores is None and device.mesh_links is None
    pipelines = pipelines and names is None and math.prod(shape) > 1
    with SideProcesses() as side:  # see [Note: planning work in processes beside the caller's]
        start = time.perf_counter()
        searching = side.submit("the pipeline search", functools.partial(
            _best_pipeline, model, inputs, math.prod(shape), budget, device)) if pipelines else None
        graph = build_op_graph(model, inputs)
        captured = time.perf_counter()
        found = _usable_layouts(graph, shape, names)
        try:
            chosen: Plan | PlanMemoryError = _fastest(graph, found, device, budget)
        except PlanMemoryError as unfit:
            if not pipelines:
                raise
            chosen = unfit  # a pipeline may fit where no placement does
        searched = time.perf_counter()
        # The count starts before the pipeline search's answer is known, and is dropped if the pipeline wins; and
        # before the named strategies are priced, which it does not read.
        counting = count_on_graphs(chosen, model, inputs, device, side) if on_graphs and isinstance(chosen, Plan) else None
        if isinstance(chosen, Plan):
            chosen = dataclasses.replace(chosen, strategies=compare_strategies(graph, shape, device, budget))
        compared = time.perf_counter()
        seconds = (("capture", captured - start), ("search", searched - captured),
                   ("the named strategies priced", compared - searched))
        piped: Plan | str = ""
        if searching is not None:
            piped = side.result(searching)
            if isinstance(piped, Plan):
                piped = dataclasses.replace(piped, batch_size=graph.batch_size)
            chosen = _faster(chosen, piped)
            seconds += (("the pipeline search", time.perf_counter() - compared),)
            compared = time.perf_counter()
            if counting is not None and chosen.pipeline is not None:
                counting.cancel()
                counting = None
        assert isinstance(chosen, Plan)
        if counting is not None:
            try:
                chosen = _fitting_on_graphs(chosen, counting.priced(chosen), graph, found, device, budget, model, inputs)
            except PlanMemoryError as unfit:  # no placement fits on its graphs; a pipeline that fits is the answer
                if not isinstance(piped, Plan):
                    raise
                return dataclasses.replace(_faster(unfit, piped), seconds=seconds, beside=_beside(side))
            if chosen.counted_on_graphs:
                seconds += (("pricing on the compiled graphs", time.perf_counter() - compared),)
                if isinstance(piped, Plan):  # both sides now priced on graphs: see [Note: one answer over placements and pipelines]
                    chosen = _faster(chosen, piped)
        return dataclasses.replace(chosen, seconds=seconds, beside=_beside(side))


def _beside(side: SideProcesses) -> tuple[tuple[str, float], ...]:
    """Each job that ran in a process beside this one and how long it took there (empty where none forked)."""
    return tuple((job.name, job.seconds) for job in side.finished)


# [Note: a plan that fits on its graphs]
# The search counts memory on its op graph; the compiled graphs can hold more (the partitioner's saved values, gathered
# parameters live together, gloo's staging buffers). Under ``on_graphs`` and a budget, a plan whose graphs hold more
# than the budget is not the answer: the search runs again under the budget scaled down by how far its count fell
# short (budget x the search's count of that plan / what its graphs held; lower still, x budget / what they held, where
# the last search's budget was), up to ``GRAPH_ROUNDS`` times, and the first plan whose graphs
# fit is the answer; where none does, ``PlanMemoryError`` names the least the graphs held. The plan's
# ``memory_budget_bytes`` stays the user's; its policy table is the last search's. A pipeline plan keeps its stage
# graphs' count (api/graph_pricing.py). The searches after the first compare placements only; their answer, counted on
# its graphs, is weighed against the pipeline search's best once more (and where no placement's graphs fit, a
# pipeline that fits is the answer): [Note: one answer over placements and pipelines].

GRAPH_ROUNDS = 3


def _fitting_on_graphs(searched: Plan, priced: Plan, graph: OpGraph, found: list[Layout], device: DeviceSpec,
                       budget: float | None, model: nn.Module, inputs: tuple[object, ...]) -> Plan:
    """``priced`` (``searched``, the search's answer, priced on its compiled graphs), or the plan searched again until
    its graphs fit: see the Note."""
    search_budget, held = budget, []
    for rounds in range(GRAPH_ROUNDS + 1):
        if budget is None or not priced.counted_on_graphs or priced.cost.memory_bytes_per_rank <= budget:
            return priced
        on_graphs = priced.cost.memory_bytes_per_rank
        held.append(f"{priced.strategy} ({policy_label(priced.activations)}) {on_graphs / 1e9:.4g} GB")
        if rounds == GRAPH_ROUNDS:
            break
        search_budget = min(search_budget * budget / on_graphs, budget * searched.cost.memory_bytes_per_rank / on_graphs)
        try:
            again = _fastest(graph, found, device, search_budget)
        except PlanMemoryError:
            break
        searched = dataclasses.replace(again, strategies=searched.strategies, pipeline_search=searched.pipeline_search,
                                       memory_budget_bytes=budget)
        priced = priced_on_graphs(searched, model, inputs, device)
    raise PlanMemoryError(
        f"no plan fits memory_budget_gb={budget / 1e9:.4g} counted on its compiled graphs: the search's plans held "
        f"{'; '.join(held)} there; raise memory_budget_gb, plan for more ranks, or plan on the op graph alone "
        "(on_graphs=False, dpar plan --op-graph), whose count is lower than the graphs'")


def _fastest(graph: OpGraph, found: list[Layout], device: DeviceSpec, budget: float | None) -> Plan:
    """Each activation policy's optimum (``solve_activations``), priced alike; the fastest that fits, with the others
    beside it to say why (see [Note: choosing the activation policy] in ``planner/solver.py``)."""
    from dpar.planner.activations import with_policy
    from dpar.planner.solver import Unfit, solve_activations

    plans: dict[Recompute, Plan] = {}
    options = []
    assignments = solve_activations(graph, found, device, budget)
    for recompute, assignment in assignments.items():
        if isinstance(assignment, Unfit):
            options.append(PolicyOption(recompute.value, assignment.layout.strategy, 0.0, 0.0,
                                        round(assignment.least_bytes), False))
            continue
        plans[recompute] = p = with_policy(evaluate(graph, assignment, device), graph, assignment, device, recompute)
        options.append(PolicyOption(recompute.value, p.strategy, p.cost.step_s, p.cost.recompute_s,
                                    p.cost.memory_bytes_per_rank, True))
    best = min(plans, key=lambda r: (plans[r].cost.step_s, POLICIES.index(r)))  # ties: the least recomputation
    chosen = plans[best]
    if best is not Recompute.KEEP and budget is not None:  # see [Note: mixing policies across blocks]
        tried = [a for a in assignments.values() if isinstance(a, Assignment)]
        mixed = _fewest_blocks(graph, found, device, budget, tried, best)
        if mixed is not None and mixed.cost.step_s < chosen.cost.step_s:
            options.append(PolicyOption(policy_label(mixed.activations), mixed.strategy, mixed.cost.step_s,
                                        mixed.cost.recompute_s, mixed.cost.memory_bytes_per_rank, True))
            chosen = mixed
    return dataclasses.replace(chosen, policies=tuple(options), memory_budget_bytes=budget)


def _fewest_blocks(
    graph: OpGraph, found: list[Layout], device: DeviceSpec, budget: float, solved: list[Assignment], best: Recompute,
) -> Plan | None:
    """The fastest plan putting the fewest blocks under a heavier policy, the rest under a lighter one, that fits
    (keep and selective when selective is the best uniform policy, selective and full when either is): on the solved
    policies' placements and on every layout without a tp axis (one candidate per op: nothing else to choose)."""
    from dpar.planner.activations import fewest_blocks, with_policy

    pairs = [(Recompute.SELECTIVE, Recompute.FULL)]
    if best is Recompute.SELECTIVE:
        pairs.insert(0, (Recompute.KEEP, Recompute.SELECTIVE))
    tried = solved + [Assignment(layout, (0,) * len(graph.ops)) for layout in found if layout.tp_degree == 1]
    plans = []
    for assignment in dict.fromkeys(tried):
        base = evaluate(graph, assignment, device)
        for lighter, heavier in pairs:
            priced = with_policy(base, graph, assignment, device, heavier)
            mixed = fewest_blocks(priced, graph, assignment, device, budget, lighter, heavier)
            if mixed is not None:
                plans.append(mixed)
    return min(plans, key=lambda p: p.cost.step_s, default=None)


def global_batch(rank_slice: Sequence[object], ranks: int) -> tuple[object, ...]:
    """Inputs shaped like ``ranks`` slices of ``rank_slice`` side by side: the global batch to plan for.

    The batch dimension is dim 0 of every tensor whose dim 0 matches the first tensor's (the
    rows ``capture`` counts); other values are kept. Only shapes matter to the planner, so the
    result is left uninitialised (``torch.empty``: no copy of the data).
    """
    leaves, spec = pytree.tree_flatten(tuple(rank_slice))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim()]
    if not tensors:
        raise OptionsError("strategy 'auto' plans from one batch: example_inputs must hold a tensor with a batch dimension")
    rows = tensors[0].shape[0]

    def widened(x: object) -> object:
        if not (isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == rows):
            return x
        return torch.empty((rows * ranks, *x.shape[1:]), dtype=x.dtype, device=x.device, requires_grad=x.requires_grad)

    return tuple(pytree.tree_unflatten([widened(x) for x in leaves], spec))


def _mesh_shape(mesh_shape: int | Sequence[int]) -> tuple[int, ...]:
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    if not shape or any(not isinstance(n, int) or n < 1 for n in shape):
        raise OptionsError(f"mesh_shape must be positive ints, such as (8,) or (2, 4); got {mesh_shape!r}")
    if dist.is_available() and dist.is_initialized() and math.prod(shape) != dist.get_world_size():
        world = dist.get_world_size()
        raise OptionsError(
            f"mesh_shape {shape} covers {math.prod(shape)} ranks but the world has {world}; "
            f"use a mesh_shape whose product is {world}, such as ({world},)"
        )
    return shape


def _mesh_dim_names(names: Sequence[str] | None, shape: tuple[int, ...]) -> tuple[str, ...] | None:
    if names is None:
        return None
    names = tuple(names)
    if len(names) != len(shape) or any(n not in ROLES for n in names):
        raise OptionsError(
            f"mesh_dim_names must name each of the {len(shape)} mesh dimension(s) 'dp', 'tp', 'ep' or 'cp'; got {names}")
    if names.count("tp") > 1:
        raise OptionsError(f"mesh_dim_names {names}: at most one dimension can be 'tp' (the runtime applies one tp axis)")
    return names


def _usable_layouts(graph: OpGraph, shape: tuple[int, ...], names: tuple[str, ...] | None) -> list[Layout]:
    """Layouts whose dp degree divides the batch and whose tp degree splits some parameter."""
    if names is not None and "tp" in names:
        tp = shape[names.index("tp")]
        if not _splits_a_parameter(graph, tp):
            linear = [op for op in graph.ops if op.kind in ("linear", "embedding")]
            example = f" ({linear[0].module}: weight {linear[0].param_shapes[0]})" if linear else ""
            raise OptionsError(
                f"mesh_dim_names {names} asks for tensor parallel over {tp} ranks, but {tp} divides no shardable "
                f"dimension of the model{example}; use a tp degree that divides the hidden sizes, or make that dimension 'dp'"
            )
    counts = tuple(info.num_experts for info in graph.experts)
    if names is not None and "ep" in names and not layouts(shape, names, counts):
        raise OptionsError(
            f"mesh_dim_names {names} asks for expert parallel over {shape[names.index('ep')]} ranks, but "
            + (f"the model's experts modules hold {sorted(set(counts))} experts, which it does not divide" if counts
               else "the model has no routed experts module")
            + "; an 'ep' axis is the last, after at most one 'dp' ('ep' or ('dp', 'ep')), of a degree dividing the experts")
    length = graph.sequence_length
    if names is not None and "cp" in names and not layouts(shape, names, counts, length):
        cp = shape[names.index("cp")]
        raise OptionsError(
            f"mesh_dim_names {names} asks for context parallel over {cp} ranks, but "
            + (f"the sequence of {length} tokens is not divisible by 2 x {cp} (two chunks a rank)" if length
               else "the model has no attention over a sequence dim of its inputs")
            + "; a 'cp' axis comes after at most one 'dp' and before at most one 'tp' ('cp', ('dp', 'cp'), "
            "('cp', 'tp') or ('dp', 'cp', 'tp'))")
    found = [
        layout for layout in layouts(shape, names, counts, length)
        if graph.batch_size % layout.dp_degree == 0 and _splits_a_parameter(graph, layout.tp_degree)
    ]
    if not found:
        dp = layouts(shape, names)[0].dp_degree if names else min(layout.dp_degree for layout in layouts(shape, None))
        raise OptionsError(
            f"the batch of {graph.batch_size} does not split over a data-parallel degree of {dp} (mesh_shape {shape}"
            f"{', mesh_dim_names ' + str(names) if names else ''}); use a batch that is a multiple of {dp}, or make "
            "a dimension 'tp' (mesh_dim_names)"
        )
    return found


def _splits_a_parameter(graph: OpGraph, tp: int) -> bool:
    """A tp degree is usable when some op can split a parameter over it (see [Note: a tp axis must split a parameter])."""
    return tp == 1 or any(cand.splits_a_parameter for op in graph.ops for cand in candidates(op, tp))


# [Note: one answer over placements and pipelines]
# ``dpar.plan`` runs two searches over the same world, batch, budget and device: the placement search (the ILP over
# every op's candidates on each layout of dp / tp / ep / cp axes, each activation policy) and the pipeline search
# (pp x tp x dp, ddp or fsdp across pipelines, 1F1B, ZB-H1 or ZBV, each policy: planner/pipeline.py). A pipeline
# of one stage is a placement, which the placement search prices with every data-parallel mode, so only pipelines of
# two stages or more compete; both price collectives on the same links (``DeviceSpec.sharing_cores``: the world's
# processes on a CPU's cores). The plan is the faster answer that fits; the other side's best is a row of ``plan.strategies``.
# Under ``on_graphs`` the placement answer is counted on its graphs and compared again with the pipeline's (priced on
# its stage graphs): the pipeline wins where the graphs' step of the placements is the longer. The pipeline search
# runs beside the capture and the placement search, and the count beside it, in forked processes ([Note: planning work
# in processes beside the caller's]): the count starts before the pipeline's answer is known and is dropped where the
# pipeline wins on the searches' prices. A
# pipeline answer is a ``Plan`` with ``pipeline`` set, mesh ``("dp", "pp", "tp")`` and the pipeline search's
# figures (``cost.bubble_s``: the span beyond the busiest rank's compute), which ``dpar.pipeline(plan=...)`` runs.
# Where no placement fits the budget, a pipeline that fits is the answer; where neither does, the error says both.
# A model the pipeline search cannot cut (no repeated blocks, keyword inputs, ...) is planned by placements alone
# and ``plan.pipeline_search`` says why. Under a live process group (``parallelize(strategy="auto")`` under torchrun)
# the pipeline search prices tp's collectives as Megatron's instead of reading them off stage graphs built in a fake
# world (which a live group rules out), and ``plan.pipeline_search`` says so.
# Not by default for ranks that are processes on a CPU's cores (``DeviceSpec.cores``, the ``cpu`` preset): neither
# search prices the host's work (a pipeline's: a graph call, sends and receives for every action, the batch gathered
# over the group), and measured on the 2-core machine the comparison went wrong both ways (2026-11-29, 4 gloo ranks,
# medians of turns): the tests' 4-block GPT, a pipeline (pp 2 x dp 2) modelled at 1.18 ms against ddp's 1.61 ran
# 24.5-25.1 ms against 12.0-12.4; benchmarks/plan_choice.py's Llama 4M, the pipeline search's best (pp 2 x dp 2, ZBV)
# modelled at 148 ms against the plan's 116 ran 316.8 ms against ddp's 332.4 (results/plan_choice_pipelines.json).
# Nor on links given by hand for the mesh's dimensions (``DeviceSpec.mesh_links``): a pipeline's (dp, pp, tp) mesh is
# not the mesh they describe. ``pipelines=True`` searches them there anyway (on the device's inter-node link).


def _best_pipeline(model: nn.Module, inputs: tuple[object, ...], world: int, budget: float | None,
                   device: DeviceSpec) -> Plan | str:
    """The pipeline search's best pipeline of two stages or more on ``world`` ranks as a plan (its own row in
    ``strategies``; its ``batch_size``, which the op graph's capture counts, left for the caller), or why there is
    none: see the Note above."""
    from dpar.compiler.pipeline_parallel.schedules import PipelineBubbleWarning
    from dpar.inspect.pipeline import block_collectives
    from dpar.pipelining import pipeline
    from dpar.planner.pipeline import SEARCHED_SCHEDULES, layout_of, plan_pipeline

    # The stage graphs are read in a fake world of their own, which a live process group rules out (parallelize's
    # "auto" under torchrun): there tp's collectives are Megatron's, and the plan says so.
    live = dist.is_available() and dist.is_initialized()
    read = None if live else functools.partial(block_collectives, model, pipeline=pipeline)
    remark = ("the pipeline search priced tp's collectives as Megatron's (two a block forward and backward): a live "
              "process group rules out reading them off the stage graphs, which dpar plan does") if live else ""
    try:
        with warnings.catch_warnings():  # the pipelines built to read tp's collectives are not the user's to tune
            warnings.simplefilter("ignore", PipelineBubbleWarning)
            found = plan_pipeline(model, inputs, world_size=world, memory_budget_gb=None if budget is None else budget / 1e9,
                                  device=device, read_tp_collectives=read, schedule=SEARCHED_SCHEDULES, min_pp=2,
                                  bounded=True)
    except PipelineMemoryError as error:
        return f"no pipeline layout fits either: {error}"
    except Exception as error:  # noqa: BLE001 - a model it cannot cut is planned by placements, and the plan says why
        return f"pipelines not searched: {type(error).__name__}: {error}"
    best = found.choice  # of two stages or more: one stage is a placement (see the Note)
    layout = layout_of(best)
    rows = f"{layout.micro_batch_rows} row" + ("s" if layout.micro_batch_rows > 1 else "")
    row = PolicyOption(best.activations, f"pipeline {best.layout}, {layout.micro_batches} micro-batches of {rows}",
                       best.step_s, best.recompute_s, best.memory_bytes, True)
    return Plan(
        mesh_shape=(best.dp, best.pp, best.tp), mesh_dim_names=("dp", "pp", "tp"),
        data_parallel="fsdp" if best.dp_strategy == "fsdp" else "replicate", strategy="pipeline",
        parameters=_pipeline_parameters(model, found, best, layout.stages),
        cost=CostBreakdown(
            compute_s=best.compute_s - best.tp_s - best.recompute_s, comm_s=best.tp_s + best.dp_comm_s,
            exposed_comm_s=best.tp_s + best.dp_comm_s, step_s=best.step_s, memory_bytes_per_rank=best.memory_bytes,
            tp_comm_s=best.tp_s, dp_comm_s=best.dp_comm_s, activation_bytes_per_rank=best.activation_bytes,
            recompute_s=best.recompute_s, bubble_s=best.pipeline_s - best.compute_s),
        batch_size=0, activations=ActivationPolicy(Recompute.parse(best.activations)), strategies=(row,),
        memory_budget_bytes=budget, priced_on="pipeline stage graphs", pipeline=layout, pipeline_search=remark,
    )


def _faster(chosen: Plan | PlanMemoryError, piped: Plan | str) -> Plan:
    """The faster of the placement plan (or, where none fits, the error saying so) and the best pipeline (or why
    there is none), the other's figures a row of ``strategies``: see the Note above."""
    if isinstance(piped, str):
        if isinstance(chosen, PlanMemoryError):
            raise PlanMemoryError(f"{chosen}. Nor does a pipeline: {piped}") from None
        return dataclasses.replace(chosen, pipeline_search=piped)
    (row,) = piped.strategies
    if isinstance(chosen, PlanMemoryError):
        return piped
    others = tuple(o for o in chosen.strategies if o != row)
    if chosen.cost.step_s <= piped.cost.step_s:
        return dataclasses.replace(chosen, strategies=(*others, row), pipeline_search=piped.pipeline_search)
    placements = PolicyOption(policy_label(chosen.activations), f"placements: {chosen.strategy}", chosen.cost.step_s,
                              chosen.cost.recompute_s, chosen.cost.memory_bytes_per_rank, True)
    return dataclasses.replace(piped, strategies=(*others, placements, row))


def _pipeline_parameters(model: nn.Module, found: PipelinePlan, chosen: PipelineCandidate,
                         stages: int) -> tuple[ParameterPlan, ...]:
    """Each parameter on the pipeline's mesh: sharded over dp under fsdp, on its stage(s) over pp (``stage 0+7``: a
    tied weight both ends read), split over tp where Megatron splits it; its ring bytes over dp and its state a rank."""
    where = found.stages_of(stages)
    dims = dict(found.tp_dims) if chosen.tp > 1 else {}
    sharded = chosen.dp_strategy == "fsdp" and chosen.dp > 1
    factor = 2 + OPTIMIZER_STATES[found.optimizer]
    aliases: dict[int, list[str]] = {}  # a tied parameter's names: the stages may name it by either
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    rows = []
    for name, p in model.named_parameters():
        dim = dims.get(name)
        nbytes = p.numel() * p.element_size() / (chosen.tp if dim is not None else 1)
        stages_of = sorted({stage for alias in aliases[id(p)] for stage in where.get(alias, ())})
        placements = ("S(0)" if sharded else "R", "stage " + "+".join(map(str, stages_of)),
                      "R" if dim is None else f"S({dim})")
        rows.append(ParameterPlan(name, tuple(p.shape), placements, round(2 * (chosen.dp - 1) / chosen.dp * nbytes),
                                  round(nbytes * factor / (chosen.dp if sharded else 1))))
    return tuple(rows)
