"""A plan: what the runtime applies (placements per parameter and mesh dimension) and what it costs.

Frozen dataclasses with a JSON round trip; ``str(plan)`` is the table ``dpar plan`` prints.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import math
from typing import Any

from dpar.core.plan import ALL_TO_ALL, KEEP_ACTIVATIONS, ActivationPolicy, Recompute
from dpar.planner.layout import Layout


@dataclasses.dataclass(frozen=True)
class ParameterPlan:
    name: str  # qualified name as in model.named_parameters()
    shape: tuple[int, ...]
    placements: tuple[str, ...]  # one per mesh dim: "R", "S(0)", "S(1)"
    comm_bytes: int  # per rank per step: this parameter's data-parallel collectives
    memory_bytes: int  # per rank: parameter + gradient + optimizer state


ON_GRAPHS = "compiled graphs"  # Plan.priced_on of a plan priced by dpar inspect (``dpar.plan(on_graphs=True)``)
# ... of a plan priced by dpar inspect on copies cut to a few blocks, extrapolated to every block (api/graph_pricing.py)
ON_BLOCK_GRAPHS = "compiled graphs of copies cut to two and three blocks, extrapolated to every block"


@dataclasses.dataclass(frozen=True)
class CostBreakdown:
    """Modelled seconds per training step (forward + backward) and bytes, on one rank. On the op graph (the
    search): memory is the state, the gathered parameters and the saved activations, the step compute plus the
    communication the phases do not hide. On the compiled graphs (``Plan.priced_on``): dpar inspect's figures,
    the memory at the step's peak and the simulated step; the tp/dp split of the communication stays the search's."""

    compute_s: float  # roofline of every op's share, forward and backward
    comm_s: float  # every collective, hidden or not: critical_comm_s + dp_comm_s
    exposed_comm_s: float  # critical_comm_s + the dp communication compute does not hide
    step_s: float  # compute_s + recompute_s + exposed_comm_s
    memory_bytes_per_rank: int  # parameter state + gathered parameters + activations (under the plan's policy)
    tp_comm_s: float = 0.0  # tensor-parallel collectives (critical path)
    dp_comm_s: float = 0.0  # data-parallel collectives (overlap with compute)
    ep_comm_s: float = 0.0  # the experts' all-to-alls (critical path)
    cp_comm_s: float = 0.0  # the attention ops' key / value gathers over cp and their gradients' (critical path)
    activation_bytes_per_rank: int = 0  # the activation part of memory_bytes_per_rank (saved, or live at the peak)
    recompute_s: float = 0.0  # forward ops run again in the backward (activation checkpointing)
    bubble_s: float = 0.0  # a pipeline's ranks idle in its schedule (step_s counts it)
    memory_bytes_keep: int | None = None  # memory_bytes_per_rank of the same placements keeping every activation
    activation_bytes_keep: int | None = None  # ... its activation part

    @property
    def critical_comm_s(self) -> float:
        """The collectives on the critical path: tp's, the experts' all-to-alls and cp's key / value exchange."""
        return self.tp_comm_s + self.ep_comm_s + self.cp_comm_s


@dataclasses.dataclass(frozen=True)
class PolicyOption:
    """The best plan the solver found under one activation policy: why the plan's policy was chosen."""

    policy: str  # keep | selective | full
    strategy: str  # "" when nothing fits under this policy
    step_s: float
    recompute_s: float
    memory_bytes_per_rank: int  # the plan's, or the smallest footprint found when nothing fits
    fits: bool


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """A pipeline chosen by the search (``Plan.pipeline``): what ``dpar.pipeline(..., plan=plan)`` runs.

    ``pp`` ranks a pipeline (``stages`` stages: one a rank, two in a V under zbv), ``tp`` ranks splitting each
    stage's layers, ``dp`` pipelines side by side under ``dp_strategy``; each pipeline runs ``micro_batches``
    micro-batches of ``micro_batch_rows`` rows a step (the rows of its ``pp x tp`` ranks' slices)."""

    pp: int
    tp: int
    dp: int
    dp_strategy: str  # ddp | fsdp
    schedule: str
    stages: int
    micro_batches: int
    micro_batch_rows: int

    @property
    def describe(self) -> str:
        return (f"pp={self.pp} x tp={self.tp} x dp={self.dp} ({self.dp_strategy}), {self.schedule}, "
                f"{self.micro_batches} micro-batches of {self.micro_batch_rows} rows")

    @property
    def mesh_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The mesh ``dpar.pipeline(plan=...)`` builds: its dimensions' names and sizes (pp, and dp and tp where
        larger than 1); ``("pp",)`` alone is the whole world, no mesh."""
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        names = tuple(name for name, size in sizes.items() if size > 1 or name == "pp")
        return names, tuple(sizes[name] for name in names)

    @property
    def mesh(self) -> str:
        """The mesh ``dpar.pipeline`` runs it on, as words."""
        names, shape = self.mesh_dims
        return f"the whole world ({self.pp} ranks)" if names == ("pp",) else f"a {names} mesh of shape {shape}"


@dataclasses.dataclass(frozen=True)
class CollectivePlan:
    """``count`` collectives of one kind per step moving ``bytes`` of payload between them (B of the ring formulas)."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all
    mesh_dim: str  # "dp", "tp", "ep" or "cp" (a dp collective over several data dims runs over all of them: "dp x ep")
    phase: str  # forward | backward
    bytes: int  # summed over the ``count`` collectives
    count: int
    where: str  # the op (or edge "producer -> consumer") it belongs to


@dataclasses.dataclass(frozen=True)
class OpPlan:
    """What one (representative) op does on the tp axis; ``count`` ops in repeated blocks share it."""

    name: str
    module: str
    kind: str
    choice: str  # replicate | column | row | vocab | shard
    count: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """[Note: which mesh axes split the data]
    Every rank is fed its own slice of the global batch (DistributedSampler's contract, as
    with DDP). Along a ``dp`` axis the ranks compute on different rows and average their
    gradients; along the ``tp`` axis they split parameters and compute on the same rows (the
    rows of the whole tp group). A ``tp`` axis along which no parameter is split would be
    neither: each rank would train on its own rows with no gradient exchange and the replicas
    would drift apart. So such an axis is a ``dp`` axis: the planner never chooses one (a
    constraint of its ILP) and ``as_run`` renames it in a plan built by hand. Along a ``cp``
    axis the ranks split every sequence of the same rows; they are fed their own rows and move
    the group's, or, where the global batch has fewer rows than the ranks that would take them
    (long sequences: ``same_batch_in_cp_group``), each cp group is fed one slice of the batch.
    """

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]  # each "dp", "tp", "ep" or "cp"
    data_parallel: str  # replicate | zero2 | fsdp: what the dp axes do to parameters
    strategy: str  # ddp, zero2, fsdp, tp, <dp>+tp, ep, <dp>+ep, cp, <dp>+cp
    parameters: tuple[ParameterPlan, ...]
    cost: CostBreakdown
    batch_size: int  # rows of the global batch the plan is priced at; the dp axes split it
    same_batch_in_cp_group: bool = False  # the batch has fewer rows than dp x cp: each cp group is fed one slice
    sequence_parallel: bool = False  # on the tp axis (Megatron-SP): parallelize(plan=...) applies it
    attention_exchange: str | None = None  # over a cp axis (core.plan.ATTENTION_EXCHANGES): parallelize(plan=...) applies it
    collectives: tuple[CollectivePlan, ...] = ()
    ops: tuple[OpPlan, ...] = ()
    activations: ActivationPolicy = KEEP_ACTIVATIONS  # what each block saves; parallelize applies it with the plan
    policies: tuple[PolicyOption, ...] = ()  # each policy's best, as the solver compared them
    strategies: tuple[PolicyOption, ...] = ()  # the named strategies on the same mesh, priced alike (side by side)
    memory_budget_bytes: float | None = None  # the budget it was planned under
    priced_on: str = "op graph"  # or ON_GRAPHS / ON_BLOCK_GRAPHS: priced by dpar inspect (api/graph_pricing.py)
    pipeline: PipelineLayout | None = None  # the answer is a pipeline: dpar.pipeline(..., plan=plan) runs it
    pipeline_search: str = ""  # what the pipeline search, where it ran, said beside its answer (or why it gave none)
    # Wall time planning took, by phase (capture, search, pricing; where work ran in processes beside the caller's,
    # the wait for it): not part of what the plan is. ``beside``: each job such a process ran, and its own time.
    seconds: tuple[tuple[str, float], ...] = dataclasses.field(default=(), compare=False)
    beside: tuple[tuple[str, float], ...] = dataclasses.field(default=(), compare=False)

    @property
    def counted_on_graphs(self) -> bool:
        """Its cost is ``dpar inspect``'s count on the compiled graphs (``dpar.plan(on_graphs=True)``)."""
        return self.priced_on in (ON_GRAPHS, ON_BLOCK_GRAPHS)

    @property
    def data_axes(self) -> tuple[int, ...]:
        """The mesh axes that split the data: every ``dp`` and ``ep`` axis (see the Note above)."""
        return tuple(i for i, name in enumerate(self.mesh_dim_names) if name in ("dp", "ep"))

    @property
    def data_parallel_degree(self) -> int:
        """How many ranks see different rows: the global batch is split this many ways."""
        return math.prod(self.mesh_shape[i] for i in self.data_axes)

    def as_run(self) -> Plan:
        """This plan as the runtime must apply it: a ``tp`` axis along which no parameter is
        split becomes a ``dp`` axis (see the Note above), its placements and the strategy follow.

        The cost is left as priced: a plan from ``dpar.plan`` never has such an axis. A pipeline plan is run as it is.
        """
        if self.pipeline is not None or "tp" not in self.mesh_dim_names \
                or any(d is not None for d in self.tp_dims().values()):
            return self
        layout = Layout(self.mesh_shape, ("dp",) * len(self.mesh_shape), self.data_parallel)
        placements = tuple(layout.dp_placement if n > 1 else "R" for n in self.mesh_shape)
        return dataclasses.replace(
            self,
            mesh_dim_names=layout.roles,
            strategy=layout.strategy,
            sequence_parallel=False,
            parameters=tuple(dataclasses.replace(p, placements=placements) for p in self.parameters),
        )

    def tp_dims(self) -> dict[str, int | None]:
        """Parameter name -> the dim sharded over the tp axis (None: replicated over it, or no tp axis)."""
        if "tp" not in self.mesh_dim_names:
            return {p.name: None for p in self.parameters}
        axis = self.mesh_dim_names.index("tp")
        return {p.name: _dim(p.placements[axis]) for p in self.parameters}

    def count(self, kind: str, mesh_dim: str, phase: str | None = None) -> int:
        """Collectives of ``kind`` on ``mesh_dim`` per step (in ``phase`` if given)."""
        return sum(c.count for c in self.collectives if c.kind == kind and c.mesh_dim == mesh_dim and phase in (None, c.phase))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, default=_enum_value)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        raw = json.loads(text)
        return cls(
            mesh_shape=tuple(raw["mesh_shape"]),
            mesh_dim_names=tuple(raw["mesh_dim_names"]),
            data_parallel=raw["data_parallel"],
            strategy=raw["strategy"],
            sequence_parallel=raw.get("sequence_parallel", False),
            attention_exchange=raw.get("attention_exchange"),
            parameters=tuple(
                ParameterPlan(**{**p, "shape": tuple(p["shape"]), "placements": tuple(p["placements"])})
                for p in raw["parameters"]
            ),
            cost=CostBreakdown(**raw["cost"]),
            batch_size=raw["batch_size"],
            same_batch_in_cp_group=raw.get("same_batch_in_cp_group", False),
            collectives=tuple(CollectivePlan(**c) for c in raw["collectives"]),
            ops=tuple(OpPlan(**o) for o in raw["ops"]),
            activations=_policy_of(raw.get("activations")),
            policies=tuple(PolicyOption(**o) for o in raw.get("policies", ())),
            strategies=tuple(PolicyOption(**o) for o in raw.get("strategies", ())),
            memory_budget_bytes=raw.get("memory_budget_bytes"),
            priced_on=raw.get("priced_on", "op graph"),
            pipeline=PipelineLayout(**raw["pipeline"]) if raw.get("pipeline") else None,
            pipeline_search=raw.get("pipeline_search", ""),
            seconds=tuple((phase, s) for phase, s in raw.get("seconds", ())),
            beside=tuple((job, s) for job, s in raw.get("beside", ())),
        )

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        render(self, Console(file=buffer, width=140, force_terminal=False, color_system=None))
        return buffer.getvalue()


def _enum_value(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _policy_of(raw: dict[str, Any] | None) -> ActivationPolicy:
    if raw is None:
        return KEEP_ACTIVATIONS
    return ActivationPolicy(
        default=Recompute.parse(raw["default"]),
        blocks=tuple((block, Recompute.parse(r)) for block, r in raw.get("blocks", ())),
        budget_bytes=raw.get("budget_bytes"),
    )


def _dim(placement: str) -> int | None:
    return int(placement[2:-1]) if placement.startswith("S(") else None


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _data_split(plan: Plan) -> str:
    """Which axes split the global batch, and the rows each rank is fed (each rank's own slice)."""
    axes = [f"{plan.mesh_dim_names[i]} ({plan.mesh_shape[i]})" for i in plan.data_axes if plan.mesh_shape[i] > 1]
    rows = f"global batch {plan.batch_size} rows, {plan.batch_size // plan.data_parallel_degree} per data-parallel rank"
    if plan.same_batch_in_cp_group:
        rows += ", the ranks of a cp group fed the same rows (parallelize(same_batch_in_cp_group=True))"
    return f"data split over: {' x '.join(axes) if axes else 'no axis (every rank computes the whole batch)'}; {rows}"


DATA_PARALLEL_STATE = {
    "replicate": "parameters replicated (DDP)",
    "zero2": "gradients and optimizer state sharded (ZeRO-2)",
    "fsdp": "parameters sharded (FSDP)",
}


def _role(plan: Plan, axis: int) -> str:
    if plan.mesh_shape[axis] == 1:
        return "size 1, nothing to split"
    if plan.pipeline is not None:
        return {"dp": f"data parallel: pipelines side by side, gradients averaged ({plan.pipeline.dp_strategy})",
                "pp": f"pipeline: {plan.pipeline.stages} stages of consecutive blocks, {plan.pipeline.schedule} schedule",
                "tp": "tensor parallel inside each stage (Megatron-style)"}[plan.mesh_dim_names[axis]]
    if plan.mesh_dim_names[axis] == "dp":
        return f"data parallel: ranks see different rows, gradients averaged; {DATA_PARALLEL_STATE[plan.data_parallel]}"
    if plan.mesh_dim_names[axis] == "ep":
        return ("expert parallel: ranks see different rows; the experts' parameters split by expert, routed "
                "tokens exchanged by all-to-all; the rest data parallel over it")
    if plan.mesh_dim_names[axis] == "cp":
        exchange = ("queries, keys and values exchanged to heads (all-to-all) at every attention"
                    if plan.attention_exchange == ALL_TO_ALL else "keys and values gathered at every attention")
        return (f"context parallel: each sequence split over it (two chunks a rank), {exchange}; parameters whole "
                "over it, gradients reduced over it")
    split = sum(1 for d in plan.tp_dims().values() if d is not None)
    return f"tensor parallel: {split} of {len(plan.parameters)} parameters split, the group computes the same rows"


def render(plan: Plan, console: Any) -> None:
    """The plan as rich tables: parameters, then collectives, then the cost breakdown."""
    from rich.table import Table

    mesh = " x ".join(f"{n} {name}" for n, name in zip(plan.mesh_shape, plan.mesh_dim_names))
    sp = ", sequence parallel" if plan.sequence_parallel else ""
    console.print(f"plan: {plan.strategy} (data_parallel={plan.data_parallel}{sp}) on mesh {mesh}")
    layout = plan.pipeline
    if layout is not None:
        rows = plan.batch_size // math.prod(plan.mesh_shape)
        console.print(f"{layout.micro_batches} micro-batches of {layout.micro_batch_rows} rows a pipeline and step "
                      f"(global batch {plan.batch_size} rows, each rank fed its own {rows})")
    else:
        console.print(_data_split(plan))
    for i, (n, name) in enumerate(zip(plan.mesh_shape, plan.mesh_dim_names)):
        console.print(f"  axis {i} {name} ({n}): {_role(plan, i)}")
    if layout is not None:
        console.print(f"run it with dpar.pipeline(model, loss_fn, example_inputs=..., plan=plan) on {layout.mesh}; "
                      "dpar.parallelize places no pipeline", markup=False, highlight=False)
    _render_parameters(plan, console)
    if plan.collectives:
        _render_collectives(plan, console)
    c = plan.cost
    _render_activations(plan, console)
    cost = Table(title=f"modelled cost per step, per rank (compute and activations counted on the {plan.priced_on})")
    cost.add_column("term")
    cost.add_column("value", justify="right")
    inspected = plan.counted_on_graphs
    comm = ((("comm (every collective, simulated)", _seconds(c.comm_s)),) if inspected else
            (("tp comm (critical path)", _seconds(c.tp_comm_s)),
             *((("ep all-to-alls (critical path)", _seconds(c.ep_comm_s)),) if c.ep_comm_s else ()),
             *((("cp key / value exchange (critical path)", _seconds(c.cp_comm_s)),) if c.cp_comm_s else ()),
             ("dp comm" + (" (after the pipeline's span)" if plan.pipeline else " (overlappable)"), _seconds(c.dp_comm_s))))
    for term, value in (
        ("compute", _seconds(c.compute_s)),
        ("recompute (activation checkpointing)", _seconds(c.recompute_s)),
        *comm,
        ("exposed comm", _seconds(c.exposed_comm_s)),
        *((("pipeline bubble", _seconds(c.bubble_s)),) if plan.pipeline else ()),
        ("step" + (" (simulated)" if inspected else ""), _seconds(c.step_s)),
        ("memory" + (" at the step's peak" if inspected else ""), _bytes(c.memory_bytes_per_rank)),
        ("  of which activations" + (" live at the peak" if inspected else " saved"), _bytes(c.activation_bytes_per_rank)),
    ):
        cost.add_row(term, value)
    console.print(cost)
    if plan.strategies:
        _render_strategies(plan, console)
    if plan.pipeline_search:
        console.print(plan.pipeline_search, markup=False, highlight=False)
    if plan.seconds:
        phases = ", ".join(f"{phase} {s:.1f} s" for phase, s in plan.seconds)
        console.print(f"planned in {sum(s for _, s in plan.seconds):.1f} s: {phases}")
    if plan.beside:
        jobs = ", ".join(f"{job} {s:.1f} s" for job, s in plan.beside)
        console.print(f"run in {len(plan.beside)} forked processes beside this one, the phases after the search "
                      f"waiting on them: {jobs}")
    if plan.memory_budget_bytes is not None and c.memory_bytes_per_rank > plan.memory_budget_bytes:
        console.print(f"warning: counted on the {plan.priced_on}, this plan holds {_bytes(c.memory_bytes_per_rank)} per rank, "
                      f"over the budget of {_bytes(plan.memory_budget_bytes)} that the search's op-graph count met")


def _render_collectives(plan: Plan, console: Any) -> None:
    from rich.table import Table

    comm = Table(title="collectives per step")
    for column in ("kind", "mesh dim", "phase", "count", "bytes", "where"):
        comm.add_column(column)
    for c in plan.collectives:
        comm.add_row(c.kind, c.mesh_dim, c.phase, str(c.count), _bytes(c.bytes), c.where)
    console.print(comm)


def _render_parameters(plan: Plan, console: Any) -> None:
    from rich.table import Table

    params = Table(title="parameters")
    for column in ("parameter", "shape", *(f"{n} ({i})" for i, n in enumerate(plan.mesh_dim_names)), "comm/step", "memory/rank"):
        params.add_column(column, justify="right" if column in ("comm/step", "memory/rank") else "left")
    for p in plan.parameters:
        params.add_row(p.name, "x".join(map(str, p.shape)), *p.placements, _bytes(p.comm_bytes), _bytes(p.memory_bytes))
    console.print(params)


def _render_strategies(plan: Plan, console: Any) -> None:
    from rich.table import Table

    table = Table(title="the named strategies on this mesh (and a pipeline's, where searched), each under its fastest "
                        "policy that fits (priced alike)")
    for column in ("strategy", "policy", "step", "recompute", "memory/rank", "fits"):
        table.add_column(column, justify="left" if column in ("strategy", "policy") else "right")
    for o in sorted(plan.strategies, key=lambda o: (not o.fits, o.step_s if o.fits else o.memory_bytes_per_rank)):
        table.add_row(o.strategy, o.policy, _seconds(o.step_s) if o.fits else "-", _seconds(o.recompute_s) if o.fits else "-",
                      _bytes(o.memory_bytes_per_rank) + ("" if o.fits else " (least)"), "yes" if o.fits else "no")
    console.print(table)


def policy_label(policy: ActivationPolicy) -> str:
    """``selective``, or ``full in 30 blocks (layers.0 .. layers.29), selective in the rest``."""
    if policy.budget_bytes is not None:
        return f"a budget of {_bytes(policy.budget_bytes)} saved"
    parts = []
    for r in Recompute:
        named = [b for b, p in policy.blocks if p is r and r is not policy.default]
        if named:
            span = f"{named[0]} .. {named[-1]}" if len(named) > 1 else named[0]
            parts.append(f"{r.value} in {len(named)} block{'s' if len(named) > 1 else ''} ({span})")
    return ", ".join([*parts, f"{policy.default.value} in the rest"]) if parts else policy.default.value


_policy_name = policy_label


def _render_activations(plan: Plan, console: Any) -> None:
    """The activation policy and why: each policy's best plan, and memory before (keep) and after (the policy)."""
    from rich.table import Table

    c = plan.cost
    budget = "no memory budget" if plan.memory_budget_bytes is None else f"budget {_bytes(plan.memory_budget_bytes)} per rank"
    where = " in every block" if not plan.activations.blocks else ""
    console.print(f"activations: {_policy_name(plan.activations)}{where} ({budget})")
    if [o.policy for o in plan.policies] == [Recompute.KEEP.value]:
        console.print("  keeping every activation fits at the fastest placements; recomputing would only add time")
    elif plan.policies:
        why = Table(title="activation policies: the fastest plan that fits wins")
        for column in ("policy", "best plan", "step", "recompute", "memory/rank", "fits"):
            why.add_column(column, justify="right" if column in ("step", "recompute", "memory/rank") else "left")
        for o in plan.policies:
            chosen = " <- chosen" if o.policy == policy_label(plan.activations) else ""
            why.add_row(
                o.policy, o.strategy or "-", _seconds(o.step_s) if o.fits else "-", _seconds(o.recompute_s) if o.fits else "-",
                _bytes(o.memory_bytes_per_rank) + ("" if o.fits else " (least found)"), ("yes" if o.fits else "no") + chosen,
            )
        console.print(why)
    if plan.activations.recomputes and c.memory_bytes_keep is not None:
        table = Table(title="memory per rank, keep vs chosen")
        for column in ("", "keep", "chosen policy"):
            table.add_column(column, justify="right" if column else "left")
        state = c.memory_bytes_per_rank - c.activation_bytes_per_rank
        table.add_row("state" + (" and gathered parameters" if plan.counted_on_graphs else ""), _bytes(state), _bytes(state))
        table.add_row("activations", _bytes(c.activation_bytes_keep or 0), _bytes(c.activation_bytes_per_rank))
        table.add_row("total", _bytes(c.memory_bytes_keep), _bytes(c.memory_bytes_per_rank))
        table.add_row("recompute added to the step", "0", _seconds(c.recompute_s))
        console.print(table)
