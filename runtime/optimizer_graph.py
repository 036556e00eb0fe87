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
otherwise steps eagerly, as the ddp model beside it would. The capture is the
compiler's optimizer stage, which the backend hands down (``OptimizerStage`` on the
model's ``ModelState``, or on the parameters of a model that has none); this module
decides when it runs and makes it the optimizer's step.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dpar.core import model_state
from dpar.core.errors import StepNotCaptured
from dpar.core.model_state import CapturedStep, OptimizerStage


class StepNotCapturedWarning(UserWarning):
    """An optimizer over dpar's parameters steps eagerly: Dynamo cannot capture its step whole."""


# Parameters whose optimizers step in a graph: a fact of the model by parameter name (ModelState), so that
# it survives swap_tensors and load_state_dict(assign=True); for a model compiled without dpar.parallelize,
# which has no state, a mark on the tensor holding the optimizer stage.
_KIND = "optimizer_in_graph"
_IN_GRAPH = "_dpar_optimizer_in_graph"


def step_in_graph(parameters: Iterable[torch.Tensor], stage: OptimizerStage) -> None:
    """Optimizers over only these (and other such) parameters step in a compiled graph from their second step."""
    parameters = list(parameters)
    for p, owner in zip(parameters, model_state.owners_of(parameters)):
        names = owner.names_of(p) if owner is not None else []
        for name in names:
            if not owner.facts(_KIND).get(name):
                owner.set_fact(_KIND, name, True)
        if not names and getattr(p, _IN_GRAPH, None) is not stage:
            setattr(p, _IN_GRAPH, stage)
            model_state.changed()


def steps_in_graph(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether an optimizer over ``parameters`` (all of them dpar's) compiles its step. Stops at the
    first other parameter."""
    seen = False
    for p in parameters:
        if not (getattr(p, _IN_GRAPH, None) is not None or model_state.fact_of(_KIND, p)):
            return False
        seen = True
    return seen


def stage_of(parameters: Iterable[torch.Tensor]) -> OptimizerStage | None:
    """The optimizer stage the backend handed down for the first of ``parameters`` (None: never compiled)."""
    for p in parameters:
        stage = getattr(p, _IN_GRAPH, None)
        if stage is not None:
            return stage
        (owner,) = model_state.owners_of([p])
        if owner is not None and owner.optimizer_stage is not None:
            return owner.optimizer_stage
    return None


class CaptureAfterFirstStep:
    """One optimizer's post-step hook: after the step it was registered in, capture its step (once)."""

    def __init__(self) -> None:
        self.decided = False  # captured, or stepping eagerly for good

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.decided:
            return
        self.decided = True
        stage = stage_of(p for group in optimizer.param_groups for p in group["params"])
        assert stage is not None, "steps_in_graph found these parameters compiled, and the backend handed a stage"
        try:
            captured = stage.capture(optimizer)
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


def unhooked(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The class's step without the wrapper that runs the step hooks."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def eager_step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """One eager step, from inside a step that already ran the hooks."""
    return unhooked(optimizer)(optimizer, *args, **kwargs)


def install_step(optimizer: torch.optim.Optimizer, run: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``run(optimizer, *args, **kwargs)`` the optimizer's ``step``, inside torch's hook wrapper (so
    every step pre- and post-hook still runs around it, in order); returns the step it replaces."""
    previous = optimizer.step
    step = types.MethodType(torch.optim.Optimizer.profile_hook_step(run), optimizer)
    if getattr(previous, "_wrapped_by_lr_sched", False):  # an LR scheduler's check that step() ran before its own
        step = _marking_called(step, optimizer)
    # Replaces the instance's step: a pre-hook cannot skip the eager step, and torch has no other way to run another.
    optimizer.step = step  # type: ignore[method-assign]
    return previous


def _marking_called(step: Callable[..., Any], optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """``step``, still telling an LR scheduler built before it that the optimizer stepped."""
    reference = weakref.ref(optimizer)

    def marked(*args: Any, **kwargs: Any) -> Any:
        reference()._opt_called = True  # type: ignore[union-attr]
        return step(*args, **kwargs)

    marked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return marked
