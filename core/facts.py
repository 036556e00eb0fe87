"""The facts ``dpar.parallelize``'s surgery records about a model, which the compiler and the runtime read.

Surgery (``surgery/``) writes them once, into the model's ``ModelState`` by parameter name (see [Note:
facts keyed by name, not by tensor] in ``model_state.py``); the backend, the passes, the optimizer hooks
and checkpoints read them here, so neither side imports the other. One section per kind of fact:
sharded parameters (fsdp, zero2, hsdp), tensor-parallel blocks, zero1's ranges, full parameters
retired by sharding, local SGD's period, and what the optimizer stage of a zero1 step reads.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dpar.core import model_state

# Sharded parameters (surgery/sharding.py).

SHARD = "shard"  # ShardSpec facts in the model's ModelState


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """One parameter's facts; how the model as a whole is sharded is its plan's (``core/plan.py``)."""

    name: str
    global_shape: tuple[int, ...]


def spec_of(param: torch.Tensor) -> ShardSpec | None:
    return model_state.fact_of(SHARD, param)


# Full parameters that sharding replaced: a fact of the model by the parameter's name, whose value is a weak
# reference to the retired tensor. It is in no model any more, so neither ``to_empty`` nor
# ``load_state_dict`` swaps it (see [Note: facts keyed by name, not by tensor]); an optimizer built before
# ``parallelize`` still holds it, and is refused by name at its first step (runtime/optimizer_hooks.py).

RETIRED = "retired"


def retired_of(model: nn.Module) -> list[torch.Tensor]:
    """The full parameters of ``model`` that sharding replaced and something still holds."""
    state = model_state.state_of(model)
    facts = state.facts(RETIRED) if state is not None else {}
    return [t for ref in facts.values() if (t := ref()) is not None]


def first_retired(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """The first of ``tensors`` that is a full parameter sharding replaced in some parallelized model."""
    retired = {id(t) for state in model_state.states() for ref in state.facts(RETIRED).values() if (t := ref()) is not None}
    return next((t for t in tensors if id(t) in retired), None) if retired else None


def retire(state: model_state.ModelState, name: str, full: torch.Tensor) -> None:
    state.set_fact(RETIRED, name, weakref.ref(full))


# Tensor-parallel blocks (surgery/tensor_parallel.py; their marker ops are runtime/tensor_parallel.py's).

TENSOR_PARALLEL = "tensor_parallel"  # TensorParallelSpec facts of split parameters in the model's ModelState


@dataclasses.dataclass(frozen=True)
class TensorParallelSpec:
    """How one parameter is split over the tensor-parallel group (``dim`` None: replicated), as the
    runtime's gather of its blocks needs it; the model-wide choices are its plan's."""

    name: str
    dim: int | None
    global_shape: tuple[int, ...]
    group_name: str
    tp_size: int
    # The mesh its state-dict DTensor lives on (``state_dict_mesh``), set when its marker is installed.
    state_dict_mesh: DeviceMesh | None = dataclasses.field(default=None, compare=False)


def tensor_parallel_spec_of(param: torch.Tensor) -> TensorParallelSpec | None:
    return model_state.fact_of(TENSOR_PARALLEL, param)


def local_block(size: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s block of ``size`` units split over ``tp_size`` ranks.

    Blocks are ``ceil(size / tp_size)`` long and the last one takes what is left
    (torch.chunk's and DTensor's layout), so a vocabulary of 50257 splits over 4
    ranks without padding the model: padding lives only inside the collectives.
    """
    block = -(-size // tp_size)
    start = min(rank * block, size)
    return start, min(block, size - start)


def can_split(size: int, tp_size: int) -> bool:
    """Whether every rank gets a non-empty block of ``size`` units."""
    return (tp_size - 1) * -(-size // tp_size) < size


# zero1's ranges (surgery/zero1.py records them; runtime/zero1.py steps them).

ZERO1 = "zero1"  # Range facts in the model's ModelState


@dataclasses.dataclass(frozen=True)
class Range:
    """This rank's range [lo, hi) of one parameter's flattened elements."""

    lo: int
    hi: int
    numel: int
    group: dist.ProcessGroup


def any_zero1(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether some of ``parameters`` have a zero1 range (an optimizer over them steps ranges)."""
    parameters = list(parameters)
    return any(o is not None and o.fact_of(ZERO1, p) is not None for p, o in zip(parameters, model_state.owners_of(parameters)))


@dataclasses.dataclass(frozen=True)
class UpdatedRange:
    """Elements [lo, hi) of ``whole``'s flattened elements, which ``view`` (the tensor the optimizer
    steps) shares storage with: what the optimizer stage's gather (compiler/passes/all_gather_ranges.py)
    is handed by the runtime's zero1 step."""

    view: torch.Tensor
    whole: torch.Tensor
    lo: int
    hi: int


# Local SGD's period (surgery/local_sgd.py attaches it; runtime/local_sgd.py and checkpoints read it).

LOCAL_SGD_PERIOD = "local_sgd_period"  # the model's Period, in its ModelState


@dataclasses.dataclass(frozen=True)
class OuterSGD:
    """DiLoCo's outer optimizer: SGD with (Nesterov) momentum on anchor - average, every period."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclasses.dataclass
class Period:
    sync_every: int
    outer: OuterSGD | None = None
    steps: int = 0  # forwards outside no_sync so far: optimizer steps taken, or being taken
    averaged_at: int = 0  # ``steps`` when the replicas were last averaged
    anchors: list[torch.Tensor] | None = None  # outer: the trained parameters where the period began
    momenta: list[torch.Tensor] | None = None

    def outer_state(self, trained: list[torch.Tensor]) -> list[torch.Tensor]:
        """Anchors then momenta, created from ``trained`` (the replicas as they start) on first use."""
        if self.anchors is None:
            self.anchors = [p.detach().clone() for p in trained]
            self.momenta = [torch.zeros_like(p) for p in trained]
        return [*self.anchors, *self.momenta]

    def next_forward(self, accumulating: bool) -> bool:
        """Whether this forward averages first; advances the count of steps."""
        average = self.steps > self.averaged_at and self.steps % self.sync_every == 0
        if average:
            self.averaged_at = self.steps
        if not accumulating:
            self.steps += 1
        return average

    def state_dict(self, trained: list[torch.Tensor]) -> dict[str, Any]:
        state: dict[str, Any] = {"steps": torch.tensor(self.steps), "averaged_at": torch.tensor(self.averaged_at)}
        if self.outer is not None:
            outer = self.outer_state(trained)
            state["outer"] = {str(i): t for i, t in enumerate(outer)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After DCP loaded into ``state_dict``'s tensors (the outer state in place)."""
        self.steps, self.averaged_at = int(state["steps"]), int(state["averaged_at"])


def period_of(parameter: torch.Tensor) -> Period | None:
    """The Period of the model ``parameter`` belongs to (see [Note: facts keyed by name, not by tensor])."""
    return model_state.model_fact_of(LOCAL_SGD_PERIOD, parameter)
