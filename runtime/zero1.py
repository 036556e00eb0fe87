"""ZeRO stage 1: whole parameters and gradients on every rank, the optimizer's state in 1/N.

[Note: how zero1 shards the optimizer]
``parallelize`` leaves the parameters whole, so the graphs are ddp's: the backward
all-reduces gradient buckets and every rank holds the whole averaged gradient
(which ``clip_grad_norm_`` can read as under DDP). Each parameter's flattened
elements are cut into N equal ranges (the last ones shorter, or empty); rank r
owns range r. The first step of an optimizer over such parameters replaces each
in its param groups by a Parameter viewing this rank's range of it, so the
optimizer creates and keeps state for those elements only (1/N), and its
``zero_grad`` clears the whole gradients too. Before every step the views'
gradients are the same elements of the whole gradients.

The step itself is the one the ddp model beside it would take, so the numbers are
DDP's bit for bit: eager where the model's step is eager (the default under
``aot_eager``), then a graph holding only the optimizer stage's pass
(compiler/passes/all_gather_ranges.py), one all-gather per dtype that brings every
rank's range into the whole parameters. Where the model's step is in a graph
(``optimizer_in_graph``, the default under Inductor; runtime/optimizer_graph.py),
from the second step on the step is captured (compiler/optimizer_step.py), the same
pass appends the gather to it, and Inductor compiles both; a step Dynamo cannot
capture whole warns once and steps eagerly, gathered as above. (A captured step
and an eager one differ in the last bits, Adam's bias corrections being fp32
tensors in one and Python floats in the other; AdamW amplifies that, after 5 steps
at lr 1e-2 by up to 3.7e-5 on a ResNet-style net, so zero1 always takes the step
ddp takes.) The gather is part of the step, not deferred to the next forward's
graph: between a step and the next forward, ``model.state_dict()``, an EMA of the
weights or an evaluation would read parameters only 1/N updated. Every step pre-
and post-hook still runs around the update, in order.

Elementwise optimizers (SGD, Adam, AdamW) give DDP's numbers; one that reads
across a parameter's elements (LAMB's trust ratio, Adafactor's factored moments)
would see only its range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dpar.core import model_state
from dpar.core.errors import OptionsError, StepNotCaptured
from dpar.core.facts import ZERO1, Range, UpdatedRange
from dpar.core.model_state import CapturedStep
from dpar.core.torch_internals import register_step_pre_hook_first
from dpar.runtime.optimizer_graph import install_captured_step, stage_of, steps_in_graph, warn_eager


# [Note: zero1's ranges by parameter name]
# Which range of each parameter this rank steps is a fact of the model, kept in its ModelState by parameter
# name (recorded at parallelize, on meta too). The Parameter viewing that range is the optimizer's: it lives
# in the optimizer's param groups, and the view knows its range and its whole parameter (``Owned``), and where
# the model holds that parameter (its slot). So the ranges survive what replaces the model's tensors:
# - ``swap_tensors`` (``to_empty``, ``module._apply``) keeps the whole Parameter but gives it new storage:
#   before each step a view that no longer shares its whole's storage is pointed at the new one (``.data``),
#   keeping the optimizer's state, which is keyed by the view;
# - ``load_state_dict(assign=True)`` puts new Parameters in the model; as torch's documentation says, the
#   optimizer must then be built again over ``model.parameters()``, and its old ``state_dict()`` loaded into
#   it. That state is the ranges' (a zero1 optimizer's state is 1/N): at its first step, when the optimizer
#   switches to the views, state it holds for a whole parameter moves to its view, cut to the range where it
#   is whole-sized (a state dict of an optimizer that stepped whole parameters). The old optimizer, stepped
#   again, would update parameters the model no longer holds (as under torch): zero1 refuses that by name.


@dataclasses.dataclass
class Owned:
    """This rank's part of one whole parameter, as its optimizer sees it."""

    view: nn.Parameter  # shares ``whole``'s storage: the optimizer's in-place step writes the whole parameter
    whole: nn.Parameter  # the model's parameter when the optimizer switched to the view (a strong reference)
    slot: Callable[[], torch.Tensor | None]  # where the model holds that parameter
    name: str
    lo: int
    hi: int
    group: dist.ProcessGroup

    def follow(self) -> torch.Tensor:
        """The whole parameter, the view pointed at its storage again if ``swap_tensors`` gave it new storage."""
        whole = self.whole
        if self.slot() is not whole:
            raise OptionsError(
                f"zero1 parameter {self.name} was replaced in the model after the optimizer stepping it was built "
                "(load_state_dict(assign=True) puts new Parameters in place), so its steps would update the old one: build the optimizer again from model.parameters() and load the old one's state_dict() "
                "into it, as torch's load_state_dict documents for assign=True"
            )
        if self.hi > self.lo and self.view.data_ptr() != whole.data_ptr() + self.lo * whole.element_size():
            self.view.data = whole.detach().view(-1)[self.lo : self.hi]
        return whole


_OWNED = "_dpar_zero1"  # on a view: its Owned (the view is the optimizer's tensor, made here)


def whole_of(parameter: torch.Tensor) -> torch.Tensor:
    """The whole parameter a zero1 range views (any other tensor: itself)."""
    owned = getattr(parameter, _OWNED, None)
    return owned.whole if owned is not None else parameter


@dataclasses.dataclass
class Stepping:
    """How one optimizer over zero1 ranges steps, and gathers the stepped ranges after."""

    owned: list[Owned]  # the optimizer's views, in its order
    captured: CapturedStep | None  # the step with the gather appended, where the model's step is in a graph
    gather_after_eager: Callable[[], None]  # the gather alone, after a step that ran eagerly


class OwnedRanges:
    """One optimizer's zero1 hooks: before its first step it switches to views of this rank's ranges; before
    every step the views' gradients are the ranges of the whole gradients; after it, the stepped ranges are
    gathered into the whole parameters (by the captured step itself, or after an eager one)."""

    def __init__(self) -> None:
        self.stepping: Stepping | None = None

    def register(self, optimizer: torch.optim.Optimizer) -> None:
        # First among the optimizer's own pre-hooks: hooks registered before the first step then read the views'
        # gradients, as when this was a process-wide hook.
        register_step_pre_hook_first(optimizer, self.before)
        optimizer.register_step_post_hook(self.after)

    def before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """Take this rank's ranges of the whole gradients. A ``step(closure)`` (Lightning's, any closure user's)
        would produce them inside the step, after this hook: the closure runs here first, and the step is handed
        one that returns its loss (closure optimizers that re-evaluate, such as LBFGS, read across a parameter's
        elements and are not zero1's anyway)."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args: (optimizer, closure?)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            args, kwargs = args[:1], {**kwargs, "closure": lambda: loss}
        if self.stepping is None:
            self.stepping = _switch_to_ranges(optimizer)
        for owned in self.stepping.owned:
            grad = owned.follow().grad
            owned.view.grad = None if grad is None else grad.reshape(-1)[owned.lo : owned.hi]
        return (args, kwargs) if closure is not None else None

    def after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Drop the views' gradients (views of the whole ones, which stay, as DDP's do); after a step that ran
        no captured graph (an eager one, or one Dynamo ran eagerly), gather the stepped ranges by the same pass."""
        stepping = self.stepping
        if stepping is None:
            return
        for owned in stepping.owned:
            owned.view.grad = None
        if stepping.captured is None or not stepping.captured.ran:
            stepping.gather_after_eager()
        if stepping.captured is not None:
            stepping.captured.ran = False


def _view_of(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """The Parameter the optimizer steps instead of ``p``: a view of this rank's range (``p`` itself if not zero1),
    with any state the optimizer holds for ``p`` moved to it."""
    (owner,) = model_state.owners_of([p])
    names = owner.names_of(p) if owner is not None else []
    r = owner.facts(ZERO1).get(names[0]) if names else None
    if r is None:
        return p
    slot = owner.slot(names[0])
    view = nn.Parameter(p.detach().view(-1)[r.lo : r.hi])
    setattr(view, _OWNED, Owned(view, p, slot, names[0], r.lo, r.hi, r.group))
    state = optimizer.state.pop(p, None)
    if state:
        optimizer.state[view] = {k: _ranged(v, r) for k, v in state.items()}
    return view


def _ranged(value: Any, r: Range) -> Any:
    """A state tensor of a whole parameter cut to the range; one already the range's size (or a scalar) as is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if value.numel() == r.numel and r.numel != r.hi - r.lo:
            return value.detach().reshape(-1)[r.lo : r.hi].clone()
        if value.numel() == r.hi - r.lo:
            return value.reshape(-1)
    return value


def _switch_to_ranges(optimizer: torch.optim.Optimizer) -> Stepping:
    """Switch ``optimizer`` to the views, and decide how its steps run (see the Note above)."""
    stage = stage_of(p for group in optimizer.param_groups for p in group["params"])
    assert stage is not None, "parallelize and the backend hand zero1's models the optimizer stage"
    for group in optimizer.param_groups:
        group["params"] = [_view_of(optimizer, p) for p in group["params"]]
    # Replaces the instance's zero_grad: torch has no zero_grad hook, and the views' zero_grad misses the whole gradients.
    optimizer.zero_grad = _clearing_whole_gradients(optimizer)  # type: ignore[method-assign]
    owned = _owned_of(optimizer)
    ranges = [UpdatedRange(o.view, o.whole, o.lo, o.hi) for o in owned]
    groups = {o.group for o in owned}
    if len(groups) > 1:
        raise OptionsError("one optimizer steps parameters of two zero1 models over different process groups: "
                           "give each model its own optimizer")
    group = groups.pop()
    where = (group.group_name, dist.get_world_size(group))
    captured = None
    if steps_in_graph(o.whole for o in owned):
        try:
            captured = stage.capture(optimizer, ranges, where)
        except StepNotCaptured as exc:
            warn_eager(exc)
        else:
            install_captured_step(optimizer, captured)
    return Stepping(owned, captured, stage.after_eager(optimizer, ranges, where))


def _owned_of(optimizer: torch.optim.Optimizer) -> list[Owned]:
    return [o for group in optimizer.param_groups for v in group["params"] if (o := getattr(v, _OWNED, None)) is not None]


def _clearing_whole_gradients(optimizer: torch.optim.Optimizer) -> Callable[..., None]:
    """The optimizer's ``zero_grad``, which now reaches its views only, extended to the whole gradients
    the backward accumulates into (a zero_grad without a step in between must clear them too)."""
    zero_grad = optimizer.zero_grad

    def clearing(set_to_none: bool = True) -> None:
        zero_grad(set_to_none)
        for group in optimizer.param_groups:
            for view in group["params"]:
                owned = getattr(view, _OWNED, None)
                if owned is None or owned.whole.grad is None:
                    continue
                if set_to_none:
                    owned.whole.grad = None
                else:
                    owned.whole.grad.zero_()

    return clearing
