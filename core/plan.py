"""The plan ``parallelize`` decides for a model, frozen: the one value the backend reads.

Per-parameter facts (a shard's global shape, a tensor-parallel block's dimension)
are core/facts.py's, by name; everything that holds for the model as a whole
(the strategy, the mesh axes and what each does, buckets, prefetch bound,
resharding, dtypes) is here, once. A model nobody parallelized has no plan and
trains as ddp over the whole world.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum

import torch
import torch.nn as nn

from dpar.core import model_state
from dpar.core.errors import OptionsError


def _parse(members: list[enum.Enum], name: str, what: str, prefix: str = "", extra: tuple[str, ...] = ()) -> enum.Enum:
    """The member spelled ``name``, or an ``OptionsError`` naming the choices and the closest one."""
    names = [*(m.value for m in members), *extra]
    found = next((m for m in members if m.value == name), None)
    if found is None:
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise OptionsError(f"{prefix}unknown {what} {name!r}{hint}; choose one of {names}")
    return found


class AxisRole(enum.Enum):
    REPLICATE = "replicate"  # whole copies of what it holds; gradients all-reduced over it
    SHARD = "shard"  # parameters, gradients and optimizer state split along dim 0 over it
    TENSOR = "tensor"  # layers split Megatron-style; activations cross it
    EXPERT = "expert"  # routed experts split over it, tokens sent to them; fed different rows, the rest replicated
    CONTEXT = "context"  # each sequence split over it (context parallel); activations cross it, parameters replicated
    # A pipeline axis (stages) is the next role.


class DataParallel(enum.Enum):
    """What a strategy does along its data axes: ZeRO's stages, and local SGD (also ``dpar.pipeline``'s ``dp_strategy``)."""

    DDP = "ddp"  # whole parameters; gradients all-reduced every step
    ZERO1 = "zero1"  # ddp's graphs; each rank keeps and steps 1/N of the optimizer state
    ZERO2 = "zero2"  # dim-0 shards at rest; a gathered parameter is kept for the backward
    FSDP = "fsdp"  # dim-0 shards; gathered parameters are freed after their forward use and gathered again
    LOCAL_SGD = "local_sgd"  # replicas step alone and are averaged every ``sync_every`` steps

    @classmethod
    def parse(cls, name: str, choices: tuple[DataParallel, ...] | None = None, prefix: str = "") -> DataParallel:
        return _parse(list(choices or cls), name, "dp_strategy", prefix)

    @property
    def all_reduces_gradients(self) -> bool:
        """Whole parameters, gradients all-reduced in buckets sized when compiling."""
        return self in (DataParallel.DDP, DataParallel.ZERO1)

    @property
    def shards_parameters(self) -> bool:
        """Parameters, gradients and optimizer state live as dim-0 shards over a data axis."""
        return self in (DataParallel.ZERO2, DataParallel.FSDP)


class Strategy(enum.Enum):
    """A strategy is a data-parallel mode and the roles of its mesh axes, in mesh order (``_SHAPES``);
    everything the layers above ask about a strategy is derived from those two."""

    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    FSDP = "fsdp"
    HSDP = "hsdp"
    TP = "tp"
    DDP_TP = "ddp+tp"
    ZERO2_TP = "zero2+tp"
    FSDP_TP = "fsdp+tp"
    LOCAL_SGD = "local_sgd"
    EP = "ep"
    DDP_EP = "ddp+ep"
    ZERO2_EP = "zero2+ep"
    FSDP_EP = "fsdp+ep"
    CP = "cp"
    DDP_CP = "ddp+cp"
    ZERO2_CP = "zero2+cp"
    FSDP_CP = "fsdp+cp"
    CP_TP = "cp+tp"
    DDP_CP_TP = "ddp+cp+tp"
    ZERO2_CP_TP = "zero2+cp+tp"
    FSDP_CP_TP = "fsdp+cp+tp"

    @classmethod
    def parse(cls, name: str, auto: bool = True) -> Strategy:
        """The strategy spelled ``name`` (the error lists ``auto`` too, which the api resolves by planning)."""
        return _parse(list(cls), name, "strategy", extra=("auto",) if auto else ())

    @classmethod
    def compose(cls, data_parallel: DataParallel | None, tensor_parallel: bool) -> Strategy:
        """The strategy of one data axis doing ``data_parallel`` (None: no data axis), with a tensor axis or not."""
        return next(s for s in cls if s.data_parallel is data_parallel and s.tensor_parallel is tensor_parallel
                    and not s.expert_parallel and not s.context_parallel
                    and len(s.roles) == (data_parallel is not None) + tensor_parallel)

    @property
    def data_parallel(self) -> DataParallel | None:
        """What the data axes do; None for tp alone, which has none."""
        return _SHAPES[self][0]

    @property
    def roles(self) -> tuple[AxisRole, ...]:
        """The role of each mesh axis, in the mesh's order."""
        return _SHAPES[self][1]

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The mesh's dimension names: ``("dp", "tp")`` with a data and a tensor axis, ``("dp", "ep")`` with an
        expert axis, ``("dp", "cp")`` with a context axis and ``("dp", "cp", "tp")`` (or ``("cp", "tp")``) with
        both (required by name), else each axis named by its role (the names of an unnamed mesh's axes)."""
        short = {AxisRole.TENSOR: "tp", AxisRole.EXPERT: "ep", AxisRole.CONTEXT: "cp"}
        if len(self.roles) > 1 and self.roles[-1] in short:
            return tuple(short.get(r, "dp") for r in self.roles)
        return tuple(short[r] if r in (AxisRole.EXPERT, AxisRole.CONTEXT) else r.value for r in self.roles)

    @property
    def tensor_parallel(self) -> bool:
        return AxisRole.TENSOR in self.roles

    @property
    def expert_parallel(self) -> bool:
        """Routed experts split over an "ep" axis (runtime/expert_parallel.py)."""
        return AxisRole.EXPERT in self.roles

    @property
    def context_parallel(self) -> bool:
        """Each sequence split over a "cp" axis (compiler/context_parallel.py)."""
        return AxisRole.CONTEXT in self.roles

    @property
    def shards_parameters(self) -> bool:
        """Parameters, gradients and optimizer state live as dim-0 shards over a data axis."""
        return self.data_parallel is not None and self.data_parallel.shards_parameters

    @property
    def reshard_after_forward(self) -> bool:
        """Gathered parameters are freed after their forward use and gathered again in the backward
        (fsdp); zero2 keeps them for the backward."""
        return self.data_parallel is DataParallel.FSDP

    @property
    def all_reduces_gradients(self) -> bool:
        """Whole parameters over the data axis, gradients all-reduced in buckets sized when compiling
        (ddp, ddp+tp, zero1)."""
        return self.data_parallel is not None and self.data_parallel.all_reduces_gradients

    @property
    def identical_gradients(self) -> bool:
        """Every rank ends the backward with the same whole reduced gradients (ddp, zero1)."""
        return self.all_reduces_gradients and not self.tensor_parallel and not self.expert_parallel

    @property
    def buckets_laid_out_by(self) -> str | None:
        """Where ``bucket_cap_mb`` applies: ``"parallelize"`` (sharded: it lays out the buckets),
        ``"compile"`` (sized from the order gradients become ready), or None (no gradient buckets)."""
        return "parallelize" if self.shards_parameters else "compile" if self.all_reduces_gradients else None


_SHAPES: dict[Strategy, tuple[DataParallel | None, tuple[AxisRole, ...]]] = {
    Strategy.DDP: (DataParallel.DDP, (AxisRole.REPLICATE,)),
    Strategy.ZERO1: (DataParallel.ZERO1, (AxisRole.REPLICATE,)),
    Strategy.ZERO2: (DataParallel.ZERO2, (AxisRole.SHARD,)),
    Strategy.FSDP: (DataParallel.FSDP, (AxisRole.SHARD,)),
    Strategy.HSDP: (DataParallel.FSDP, (AxisRole.REPLICATE, AxisRole.SHARD)),
    Strategy.TP: (None, (AxisRole.TENSOR,)),
    Strategy.DDP_TP: (DataParallel.DDP, (AxisRole.REPLICATE, AxisRole.TENSOR)),
    Strategy.ZERO2_TP: (DataParallel.ZERO2, (AxisRole.SHARD, AxisRole.TENSOR)),
    Strategy.FSDP_TP: (DataParallel.FSDP, (AxisRole.SHARD, AxisRole.TENSOR)),
    Strategy.LOCAL_SGD: (DataParallel.LOCAL_SGD, (AxisRole.REPLICATE,)),
    # The ep axis is a data axis too: the parameters outside the experts are ddp's over it.
    Strategy.EP: (DataParallel.DDP, (AxisRole.EXPERT,)),
    Strategy.DDP_EP: (DataParallel.DDP, (AxisRole.REPLICATE, AxisRole.EXPERT)),
    # The experts' blocks sharded over "dp", the rest over every rank (see ShardedGroups).
    Strategy.ZERO2_EP: (DataParallel.ZERO2, (AxisRole.SHARD, AxisRole.EXPERT)),
    Strategy.FSDP_EP: (DataParallel.FSDP, (AxisRole.SHARD, AxisRole.EXPERT)),
    # Parameters whole over the cp axis; their gradients, partial sums over it, reduced in the graph.
    Strategy.CP: (None, (AxisRole.CONTEXT,)),
    Strategy.DDP_CP: (DataParallel.DDP, (AxisRole.REPLICATE, AxisRole.CONTEXT)),
    Strategy.ZERO2_CP: (DataParallel.ZERO2, (AxisRole.SHARD, AxisRole.CONTEXT)),
    Strategy.FSDP_CP: (DataParallel.FSDP, (AxisRole.SHARD, AxisRole.CONTEXT)),
    # Both activation axes: the sequence split over "cp", each rank's share of it split Megatron-style over "tp".
    Strategy.CP_TP: (None, (AxisRole.CONTEXT, AxisRole.TENSOR)),
    Strategy.DDP_CP_TP: (DataParallel.DDP, (AxisRole.REPLICATE, AxisRole.CONTEXT, AxisRole.TENSOR)),
    Strategy.ZERO2_CP_TP: (DataParallel.ZERO2, (AxisRole.SHARD, AxisRole.CONTEXT, AxisRole.TENSOR)),
    Strategy.FSDP_CP_TP: (DataParallel.FSDP, (AxisRole.SHARD, AxisRole.CONTEXT, AxisRole.TENSOR)),
}

_NO_BUCKETS = {
    Strategy.TP: "its collectives carry activations, each where the graph needs it",
    Strategy.CP: "its gradients are reduced over the cp axis in the graph, each where it is computed",
    Strategy.CP_TP: "its gradients are reduced over the cp axis in the graph, each where it is computed",
    Strategy.LOCAL_SGD: "it averages the parameters every sync_every steps, one flattened all-reduce per dtype",
}


def check_bucket_cap(strategy: Strategy | None, given_to: str, bucket_cap_mb: float | None) -> None:
    """The one place ``bucket_cap_mb`` is policed: given to ``given_to`` (``"parallelize"`` or ``"compile"``)
    under ``strategy`` (None: ``auto``, not chosen yet), it must be where that strategy's buckets are laid out."""
    if bucket_cap_mb is None:
        return
    if given_to == "parallelize" and not (
        isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool) and bucket_cap_mb > 0
    ):
        raise OptionsError(f"bucket_cap_mb must be None (per block) or a number > 0, got {bucket_cap_mb!r}")
    where = None if strategy is None else strategy.buckets_laid_out_by
    if where == given_to:
        return
    if strategy is None:
        raise OptionsError(
            "strategy='auto' chooses the strategy, so where buckets are sized is not known yet: plan first, "
            "plan = dpar.plan(...), then parallelize(model, plan=plan, bucket_cap_mb=...) for a sharded plan"
        )
    if given_to == "parallelize" and where is None:
        raise OptionsError(
            f"strategy {strategy.value!r} has no gradient buckets ({_NO_BUCKETS[strategy]}): leave bucket_cap_mb unset"
        )
    if given_to == "parallelize":
        raise OptionsError(
            f"under {strategy.value!r} gradient buckets are sized when compiling, in the order gradients become "
            f"ready: pass torch.compile(model, backend='dpar', options={{'bucket_cap_mb': {bucket_cap_mb}}}) "
            "instead of parallelize(..., bucket_cap_mb=...)"
        )
    if where == "parallelize":
        why = ("sharded, and their buckets are laid out by parallelize: pass dpar.parallelize(model, "
               "strategy=..., bucket_cap_mb=...) and leave it out of torch.compile's options")
    elif strategy is Strategy.LOCAL_SGD:
        why = f"averaged by local SGD, with no gradient buckets ({_NO_BUCKETS[strategy]}): leave bucket_cap_mb out"
    else:
        why = f"split by strategy {strategy.value!r}, which has no gradient buckets: leave bucket_cap_mb out"
    raise OptionsError("options={'bucket_cap_mb': ...} sizes ddp's gradient buckets; these parameters are " + why)


class Recompute(enum.Enum):
    """What a block keeps from its forward for the backward, and what it computes again (activation checkpointing)."""

    KEEP = "keep"  # every activation the backward reads is saved
    SELECTIVE = "selective"  # matmul and attention outputs saved; the cheap ops between them recomputed
    FULL = "full"  # only the block's inputs saved; the whole block's forward recomputed in its backward

    @classmethod
    def parse(cls, name: str, prefix: str = "") -> Recompute:
        return _parse(list(cls), name, "activation policy", prefix)


@dataclasses.dataclass(frozen=True)
class ActivationPolicy:
    """Activation checkpointing as part of the plan: a policy per block (a repeated layer such as
    ``layers.3``), or a budget of saved-activation bytes per rank that the recomputation must fit.

    ``default`` applies to every block not named in ``blocks`` (block path -> its own policy); the ops
    outside blocks (embeddings, the head, the loss) are left to the partitioner. ``budget_bytes`` replaces
    the per-block choice: the first policy on the ladder keep -> selective -> full, one block at a time,
    whose forward saves at most that many bytes per rank (compiler/passes/recompute.py's ``fit_budget``).
    Applied by compiler/passes/recompute.py under every strategy; ``dpar.parallelize(...,
    activation_checkpointing=...)`` builds one from a name or a ``{block: name}`` dict.
    """

    default: Recompute = Recompute.KEEP
    blocks: tuple[tuple[str, Recompute], ...] = ()
    budget_bytes: int | None = None

    def of_block(self, block: str) -> Recompute:
        return next((r for b, r in self.blocks if b == block), self.default)

    @property
    def recomputes(self) -> bool:
        return self.budget_bytes is not None or any(
            r is not Recompute.KEEP for r in (self.default, *(r for _, r in self.blocks)))

    def __str__(self) -> str:
        if self.budget_bytes is not None:
            return f"a budget of {self.budget_bytes:,} saved bytes per rank"
        return ", ".join([self.default.value, *(f"{block} {r.value}" for block, r in self.blocks)])


KEEP_ACTIVATIONS = ActivationPolicy()

ALL_GATHER, ALL_TO_ALL = "all_gather", "all_to_all"
ATTENTION_EXCHANGES = (ALL_GATHER, ALL_TO_ALL)
"""How attention reads other ranks' tokens over a context-parallel axis: keys and values gathered, or Ulysses'
all-to-all to heads (see [Note: two ways to exchange a sequence for attention])."""


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    name: str
    role: AxisRole
    size: int
    group_name: str  # this rank's process group along the axis


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    strategy: Strategy
    axes: tuple[MeshAxis, ...]
    buckets: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Sharded strategies: bucket -> parameter names, in module order (ddp sizes its buckets when
    compiling, from the order gradients become ready)."""
    max_inflight_gathers: int | None = None  # None: chosen from cost (compiler/passes/prefetch.py), parallelize's default
    param_dtype: torch.dtype | None = None  # gathered and computed in; None: as stored
    reduce_dtype: torch.dtype | None = None  # gradients reduce-scattered in; None: as computed
    sequence_parallel: bool = False
    same_batch_in_tp_group: bool = False  # the user feeds every rank of a tensor-parallel group the same rows
    same_batch_in_cp_group: bool = False  # the user feeds every rank of a context-parallel group the same rows
    sync_every: int | None = None  # local_sgd: optimizer steps between averages of the replicas
    activations: ActivationPolicy = KEEP_ACTIVATIONS  # what each block saves for the backward, what it recomputes
    rows_group: MeshAxis | None = None
    """With a context and a tensor axis: the two flattened into one group, whose ranks compute one another's
    rows ([Note: the data contract under tensor parallel]); set by ``parallelize``."""
    attention_exchange: str | None = None
    """With a context axis: how attention sees the other ranks' tokens, ``"all_gather"`` (keys and values) or
    ``"all_to_all"`` (heads, Ulysses); None: per attention, the cheaper by bytes."""

    def axis(self, role: AxisRole) -> MeshAxis | None:
        return next((a for a in self.axes if a.role is role), None)

    def bucket_of(self, parameter: str) -> str:
        return next(bucket for bucket, names in self.buckets if parameter in names)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def data_axes(self) -> tuple[MeshAxis, ...]:
        """The axes along which ranks are fed different rows (a tensor or context axis moves its group's rows itself)."""
        return tuple(a for a in self.axes if a.role not in (AxisRole.TENSOR, AxisRole.CONTEXT))


def replicated(group_name: str, size: int) -> ParallelPlan:
    """ddp over one group: what a model without a plan trains as."""
    return ParallelPlan(Strategy.DDP, (MeshAxis("dp", AxisRole.REPLICATE, size, group_name),))


def attach(plan: ParallelPlan, model: nn.Module) -> None:
    """Make ``plan`` the one the backend reads for a graph that takes ``model``'s parameters (kept in its
    ModelState, found from the parameters however they are materialized or loaded later)."""
    model_state.state_of(model, create=True).plan = plan


def plan_of_model(model: nn.Module) -> ParallelPlan | None:
    state = model_state.state_of(model)
    return None if state is None else state.plan


def plan_of_parameters(parameters: dict[str, torch.Tensor]) -> ParallelPlan | None:
    """The plan of the model these parameters (by graph input name) belong to, or None (ddp).

    One graph may hold parameters of one parallelized model only: the rest would
    get no gradient synchronisation, which is silent, so it is refused.
    """
    owners = model_state.owners_of(parameters.values())
    planned = {name: (s.plan if s is not None else None) for name, s in zip(parameters, owners)}
    plans = {id(p): p for p in planned.values() if p is not None}
    if not plans:
        return None
    unplanned = [name for name, p in planned.items() if p is None]
    if len(plans) > 1 or unplanned:
        what = (f"parameter {unplanned[0]} belongs to no model dpar.parallelize was called on" if unplanned
                else "its parameters come from models parallelized separately")
        raise OptionsError(
            f"one compiled graph mixes parameters of different plans: {what}. Call dpar.parallelize once on "
            "the module that owns every parameter the compiled function reads (wrap the models in one nn.Module)"
        )
    return next(iter(plans.values()))
