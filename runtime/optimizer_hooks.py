"""The one process-wide optimizer hook dpar registers, and the hooks it registers on each optimizer.

[Note: optimizer hooks, per optimizer]
Optimizers are built by the user, after ``parallelize`` and usually before the first compile, so dpar
cannot hook them when they are made. One process-wide step pre-hook (``watch_optimizers``, registered
once, when a model is parallelized or compiled with something an optimizer must do) looks at every
optimizer when it steps: it finds the ``ModelState`` of its parameters and registers on that optimizer
its own hooks for what the model needs, once:

- zero1's ranges (runtime/zero1.py): the switch to views of this rank's ranges, their gradients before
  each step, the gather of the stepped ranges after it;
- a step in a compiled graph (runtime/optimizer_graph.py): captured after the first step;
- a full parameter that sharding replaced (an optimizer built before ``parallelize``): refused by name at
  every step, here, before anything steps.

What it found is kept on the optimizer (``_Found``): the answer is asked again only when some model
gains a fact (``model_state.generation``) or the optimizer's parameters change, since a model compiled
later may make an optimizer's parameters dpar's. The captured steps themselves are the compiler's
optimizer stage, which the backend hands down (``hand_down``) on the model's ``ModelState``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from dpar.core import model_state
from dpar.core.errors import OptionsError
from dpar.core.facts import ZERO1, any_zero1, first_retired
from dpar.core.model_state import OptimizerStage
from dpar.runtime import zero1
from dpar.runtime.parameter_writes import keep_foreach_default
from dpar.runtime.optimizer_graph import CaptureAfterFirstStep, step_in_graph, steps_in_graph

_ATTRIBUTE = "_dpar_hooks"  # on an optimizer: what the discovery hook found for it
_watching: RemovableHandle | None = None  # the process-wide discovery hook, once registered


@dataclasses.dataclass
class _Found:
    """What the discovery hook found for one optimizer, and when it last looked."""

    asked: tuple[int, tuple[int, ...]] = (-1, ())  # (model_state.generation, ids of its parameters)
    hooked: str | None = None  # "zero1" or "optimizer_in_graph": the hooks registered on it


def watch_optimizers() -> None:
    """From now on, every optimizer that steps is looked at once (see the Note above)."""
    global _watching
    if _watching is None:
        _watching = register_optimizer_step_pre_hook(_discover)


def hand_down(stage: OptimizerStage, parameters: Iterable[torch.Tensor], in_graph: Iterable[torch.Tensor] = ()) -> None:
    """From the backend, at each compile: the pass listing's optimizer stage for the models holding ``parameters``,
    and ``in_graph``, the parameters whose optimizers step in a compiled graph."""
    parameters, in_graph = list(parameters), list(in_graph)
    owners = {id(o): o for o in model_state.owners_of(parameters) if o is not None}
    for owner in owners.values():
        owner.optimizer_stage = stage
    if in_graph:
        step_in_graph(in_graph, stage)
    if in_graph or any(owner.facts(ZERO1) for owner in owners.values()):
        watch_optimizers()


def _discover(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    key = (model_state.generation, tuple(map(id, params)))  # the optimizer holds its parameters: no id is reused
    found = optimizer.__dict__.get(_ATTRIBUTE)
    if found is not None and found.asked == key:
        return
    if first_retired(params) is not None:
        raise OptionsError(
            f"this {type(optimizer).__name__} was built before dpar.parallelize, so it holds the "
            "full parameters that parallelize replaced by shards (their gradients never come): "
            "build the optimizer after parallelize, from model.parameters()"
        )
    keep_foreach_default(optimizer)
    if found is None:
        found = optimizer.__dict__[_ATTRIBUTE] = _Found()
    if found.hooked is None:
        if any_zero1(params):
            zero1.OwnedRanges().register(optimizer)
            found.hooked = "zero1"
        elif steps_in_graph(params):
            optimizer.register_step_post_hook(CaptureAfterFirstStep())
            found.hooked = "optimizer_in_graph"
    found.asked = key
