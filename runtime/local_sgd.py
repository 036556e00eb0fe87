"""Local SGD: where a model is in its averaging period, and the forward variant each call runs.

[Note: when local SGD averages]
Every rank steps its own replica on its own rows, with no gradient
communication. After every ``sync_every`` optimizer steps the replicas are
averaged: the forward that follows the H-th step runs a variant whose first
collective averages the parameters and writes the averages back. A step is a
forward outside ``no_sync`` (the micro-batches inside it accumulate into the same
step), so accumulation does not shift the period; the averaging forward may be
the first micro-batch of a step. With plain SGD and ``sync_every=1`` every forward
sees DDP's parameters of that step: the average of the replicas' SGD steps from
one common point is the step on the average gradient. The period's position is
saved with ``dpar.checkpoint`` so a resumed run averages where the uninterrupted
one would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from dpar.core import model_state
from dpar.runtime.gradient_sync import inside_no_sync


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


_KIND = "local_sgd_period"  # the model's Period, in its ModelState


def attach(period: Period, model: nn.Module) -> None:
    model_state.state_of(model, create=True).set_model_fact(_KIND, period)


def period_of(parameter: torch.Tensor) -> Period | None:
    """The Period of the model ``parameter`` belongs to (see [Note: facts keyed by name, not by tensor])."""
    return model_state.model_fact_of(_KIND, parameter)


def choose_variant(
    period: Period,
    parameters: list[Callable[[], torch.Tensor | None]],
    trained: list[Callable[[], torch.Tensor | None]],
) -> Callable[[], tuple[bool, list[torch.Tensor]]]:
    """For ``ForwardDispatch``: whether this forward averages, and the extra inputs it then takes
    (DiLoCo's anchors and momenta; the anchors are the replicas as the first forward finds them)."""

    def choose() -> tuple[bool, list[torch.Tensor]]:
        live = [p for p in (ref() for ref in parameters) if p is not None]
        outer = period.outer_state([ref() for ref in trained]) if period.outer is not None else []
        average = period.next_forward(accumulating=inside_no_sync(live))
        return average, outer if average else []

    return choose
