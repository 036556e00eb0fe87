"""The optimizer's step as one compiled graph, for the models dpar trains.

[Note: the optimizer step in the graph]
Eager AdamW runs a dozen foreach ops per step, each a pass over every parameter;
over DTensors (fsdp, zero2) it is a dozen ops per parameter, each through
DTensor's dispatch. For the parameters of a model compiled with
``options={"optimizer_in_graph": True}`` (the default when the inner compiler is
Inductor), dpar captures the step of every optimizer that steps only such
parameters (compiler/optimizer_step.py) and compiles it with Inductor, which
fuses the update into a few loops over the parameters' local shards, as
``torch.compile(optimizer.step)`` does and with its numbers bit for bit. Those
differ from the eager step's in the last bits (Adam's bias corrections are fp32
tensors in a captured step, Python floats in the eager one), then grow as Adam
divides by small second moments: after 6 AdamW steps at lr 1e-2 the largest
difference is 2e-4, which is torch's own compiled step's difference too.

The first step of each optimizer runs eagerly and creates its state; the
capture and the Inductor compile (10-20 s on CPU) happen at the second. A step
with a closure runs eagerly. An optimizer Dynamo cannot capture whole (or built
with ``differentiable=True``) steps eagerly from then on, with a
``StepNotCapturedWarning`` naming why. zero1 captures its own steps where
``steps_in_graph`` says so (it appends the gather of the stepped ranges to them) and
otherwise steps eagerly, as the ddp model beside it would.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from dpar.compiler.optimizer_step import CapturedStep, StepNotCaptured, eager_step, inductor_step, install_step
from dpar.core import model_state


class StepNotCapturedWarning(UserWarning):
    """An optimizer over dpar's parameters steps eagerly: Dynamo cannot capture its step whole."""


# Parameters whose optimizers step in a graph: a fact of the model by parameter name (ModelState), so that
# it survives swap_tensors and load_state_dict(assign=True); a mark on the tensor for a model compiled
# without dpar.parallelize, which has no state.
_KIND = "optimizer_in_graph"
_IN_GRAPH = "_dpar_optimizer_in_graph"
_decided: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # captured, or stepping eagerly for good
_not_in_graph = model_state.AnsweredNo()  # optimizers found stepping other parameters
_hook_installed = False


def step_in_graph(parameters: Iterable[torch.Tensor]) -> None:
    """Optimizers over only these (and other such) parameters step in a compiled graph from their second step."""
    global _hook_installed
    parameters = list(parameters)
    for p, owner in zip(parameters, model_state.owners_of(parameters)):
        names = owner.names_of(p) if owner is not None else []
        for name in names:
            if not owner.facts(_KIND).get(name):
                owner.set_fact(_KIND, name, True)
        if not names:
            setattr(p, _IN_GRAPH, True)
    if not _hook_installed:
        register_optimizer_step_post_hook(_capture_after_first_step)
        _hook_installed = True


def steps_in_graph(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether an optimizer over ``parameters`` (all of them dpar's) compiles its step. Stops at the
    first other parameter: the post-step hook asks this after every step of every other optimizer."""
    seen = False
    for p in parameters:
        if not (getattr(p, _IN_GRAPH, False) or model_state.fact_of(_KIND, p)):
            return False
        seen = True
    return seen


def _capture_after_first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _decided:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _not_in_graph.still_no(optimizer, params):
        return  # asked before, and no model has gained facts since
    if not steps_in_graph(params):
        _not_in_graph.no(optimizer, params)
        return  # not (yet) all dpar's: a model compiled later may make them so
    _decided.add(optimizer)
    try:
        captured = CapturedStep(optimizer, lambda inputs: [], inductor_step)
    except StepNotCaptured as exc:
        warn_eager(exc)
        return
    install_captured_step(optimizer, captured)


def install_captured_step(optimizer: torch.optim.Optimizer, captured: CapturedStep) -> None:
    """Make ``captured`` the optimizer's step. A step with a closure runs eagerly; a step Dynamo cannot
    capture whole warns once and runs eagerly from then on (``captured.ran`` stays False for both)."""

    def run(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs.get("closure") is not None:
            return eager_step(optimizer, *args, **kwargs)
        try:
            return captured()
        except StepNotCaptured as exc:
            optimizer.step = previous  # type: ignore[method-assign]
            warn_eager(exc)
            return eager_step(optimizer)

    previous = install_step(optimizer, run)


def warn_eager(exc: StepNotCaptured) -> None:
    warnings.warn(
        f"{exc}; it steps eagerly from now on, one op per parameter group (or per parameter over DTensors). "
        "For a fused step use an optimizer Dynamo captures (SGD, Adam, AdamW, ...) with differentiable=False; "
        "options={'optimizer_in_graph': False} silences this",
        StepNotCapturedWarning,
        stacklevel=3,
    )
