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
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from dpar.compiler.optimizer_step import CapturedStep, PassesAfterEagerStep, StepNotCaptured, inductor_step
from dpar.compiler.passes.all_gather_ranges import UpdatedRange
from dpar.compiler.pipeline import optimizer_passes
from dpar.compiler.plan import Strategy
from dpar.runtime.errors import OptionsError
from dpar.runtime.optimizer_graph import install_captured_step, steps_in_graph, warn_eager


def owned_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of a parameter's flattened elements that ``rank`` steps: ranges of ceil(numel / N)."""
    chunk = -(-numel // world_size)
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


@dataclasses.dataclass
class Owned:
    """This rank's part of one whole parameter, as its optimizer sees it."""

    whole: nn.Parameter
    view: nn.Parameter  # shares ``whole``'s storage: the optimizer's in-place step writes the whole parameter
    lo: int
    hi: int
    group: dist.ProcessGroup


_owned: WeakIdKeyDictionary = WeakIdKeyDictionary()  # whole parameter -> Owned
_views: WeakIdKeyDictionary = WeakIdKeyDictionary()  # view -> Owned
_hooks_installed = False


def shard_optimizer_state(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Give each trained parameter its view of this rank's range; optimizers switch to them at their first step."""
    global _hooks_installed
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    for p in parameters:
        # A parameter on meta gets its range when a graph first reads it materialized (compiler/backend.py).
        if p.requires_grad and not p.is_meta and p not in _owned:
            lo, hi = owned_range(p.numel(), world_size, rank)
            owned = Owned(p, nn.Parameter(p.detach().view(-1)[lo:hi]), lo, hi, group)
            _owned[p] = _views[owned.view] = owned
    if not _hooks_installed:
        register_optimizer_step_pre_hook(_step_on_owned_ranges)
        register_optimizer_step_post_hook(_after_step)
        _hooks_installed = True


def is_zero1(parameter: torch.Tensor) -> bool:
    return parameter in _owned


def whole_of(parameter: torch.Tensor) -> torch.Tensor:
    """The whole parameter a zero1 range views (any other tensor: itself)."""
    owned = _views.get(parameter)
    return owned.whole if owned is not None else parameter


@dataclasses.dataclass
class Stepping:
    """How one optimizer over zero1 ranges steps, and gathers the stepped ranges after."""

    captured: CapturedStep | None  # the step with the gather appended, where the model's step is in a graph
    gather_after_eager: PassesAfterEagerStep  # the gather alone, after a step that ran eagerly


_stepping: weakref.WeakKeyDictionary[torch.optim.Optimizer, Stepping] = weakref.WeakKeyDictionary()


def _step_on_owned_ranges(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer not in _stepping and any(p in _owned for g in optimizer.param_groups for p in g["params"]):
        _switch_to_ranges(optimizer)
    for group in optimizer.param_groups:
        for view in group["params"]:
            owned = _views.get(view)
            if owned is not None:
                grad = owned.whole.grad
                view.grad = None if grad is None else grad.reshape(-1)[owned.lo : owned.hi]


def _switch_to_ranges(optimizer: torch.optim.Optimizer) -> None:
    """Switch ``optimizer`` to the views, and decide how its steps run (see the Note above)."""
    for group in optimizer.param_groups:
        group["params"] = [_owned[p].view if p in _owned else p for p in group["params"]]
    optimizer.zero_grad = _clearing_whole_gradients(optimizer)  # type: ignore[method-assign]
    owned = _owned_of(optimizer)
    ranges = [UpdatedRange(o.view, o.whole, o.lo, o.hi) for o in owned]
    groups = {o.group for o in owned}
    if len(groups) > 1:
        raise OptionsError("one optimizer steps parameters of two zero1 models over different process groups: "
                           "give each model its own optimizer")
    group = groups.pop()
    where = (group.group_name, dist.get_world_size(group))

    def passes(inputs):
        return optimizer_passes(Strategy.ZERO1, ranges, inputs, where)

    captured = None
    if steps_in_graph(o.whole for o in owned):
        try:
            captured = CapturedStep(optimizer, passes, inductor_step)
        except StepNotCaptured as exc:
            warn_eager(exc)
        else:
            install_captured_step(optimizer, captured)
    _stepping[optimizer] = Stepping(captured, PassesAfterEagerStep(optimizer, passes))


def _owned_of(optimizer: torch.optim.Optimizer) -> list[Owned]:
    return [_views[v] for group in optimizer.param_groups for v in group["params"] if v in _views]


def _clearing_whole_gradients(optimizer: torch.optim.Optimizer) -> Callable[..., None]:
    """The optimizer's ``zero_grad``, which now reaches its views only, extended to the whole gradients
    the backward accumulates into (a zero_grad without a step in between must clear them too)."""
    zero_grad = optimizer.zero_grad

    def clearing(set_to_none: bool = True) -> None:
        zero_grad(set_to_none)
        for group in optimizer.param_groups:
            for view in group["params"]:
                owned = _views.get(view)
                if owned is None or owned.whole.grad is None:
                    continue
                if set_to_none:
                    owned.whole.grad = None
                else:
                    owned.whole.grad.zero_()

    return clearing


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Drop the views' gradients (views of the whole ones, which stay, as DDP's do); after a step that ran
    no captured graph (an eager one, or one Dynamo ran eagerly), gather the stepped ranges by the same pass."""
    stepping = _stepping.get(optimizer)
    if stepping is None:
        return
    for owned in _owned_of(optimizer):
        owned.view.grad = None
    if stepping.captured is None or not stepping.captured.ran:
        stepping.gather_after_eager()
    if stepping.captured is not None:
        stepping.captured.ran = False
