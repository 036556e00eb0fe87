"""The plan ``parallelize`` decides for a model, frozen: the one value the backend reads.

Per-parameter facts (a shard's global shape, a tensor-parallel block's dimension)
stay with the runtime's specs; everything that holds for the model as a whole
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


class Strategy(enum.Enum):
    DDP = "ddp"
    ZERO2 = "zero2"
    FSDP = "fsdp"
    HSDP = "hsdp"
    TP = "tp"
    DDP_TP = "ddp+tp"
    ZERO2_TP = "zero2+tp"
    FSDP_TP = "fsdp+tp"
    LOCAL_SGD = "local_sgd"  # replicas step alone and are averaged every ``sync_every`` steps
    ZERO1 = "zero1"  # ddp's graphs; each rank keeps and steps 1/N of the optimizer state

    @classmethod
    def parse(cls, name: str) -> Strategy:
        names = [s.value for s in cls]
        if name not in names:
            close = difflib.get_close_matches(str(name), [*names, "auto"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise OptionsError(f"unknown strategy {name!r}{hint}; choose one of {[*names, 'auto']}")
        return cls(name)

    @property
    def tensor_parallel(self) -> bool:
        return self in (Strategy.TP, Strategy.DDP_TP, Strategy.ZERO2_TP, Strategy.FSDP_TP)

    @property
    def shards_parameters(self) -> bool:
        """Parameters, gradients and optimizer state live as dim-0 shards over a data axis."""
        return self in (Strategy.ZERO2, Strategy.FSDP, Strategy.HSDP, Strategy.ZERO2_TP, Strategy.FSDP_TP)

    @property
    def reshard_after_forward(self) -> bool:
        """Gathered parameters are freed after their forward use and gathered again in the backward
        (fsdp); zero2 keeps them for the backward."""
        return self in (Strategy.FSDP, Strategy.HSDP, Strategy.FSDP_TP)


class AxisRole(enum.Enum):
    REPLICATE = "replicate"  # whole copies of what it holds; gradients all-reduced over it
    SHARD = "shard"  # parameters, gradients and optimizer state split along dim 0 over it
    TENSOR = "tensor"  # layers split Megatron-style; activations cross it
    # A pipeline axis (stages) is the next role.


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
    sync_every: int | None = None  # local_sgd: optimizer steps between averages of the replicas

    def axis(self, role: AxisRole) -> MeshAxis | None:
        return next((a for a in self.axes if a.role is role), None)

    def bucket_of(self, parameter: str) -> str:
        return next(bucket for bucket, names in self.buckets if parameter in names)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def data_axes(self) -> tuple[MeshAxis, ...]:
        """The axes along which ranks are fed different rows."""
        return tuple(a for a in self.axes if a.role is not AxisRole.TENSOR)


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
