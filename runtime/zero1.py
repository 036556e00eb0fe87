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
gradients are the same elements of the whole gradients. The step writes this rank's
elements in place, and right after it one all-gather per dtype brings every
rank's range into the whole parameters. That gather is not deferred to the next
forward's graph: between a step and the next forward, ``model.state_dict()``, an
EMA of the weights or an evaluation would read parameters only 1/N updated.
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
        if p.requires_grad and p not in _owned:
            lo, hi = owned_range(p.numel(), world_size, rank)
            owned = Owned(p, nn.Parameter(p.detach().view(-1)[lo:hi]), lo, hi, group)
            _owned[p] = _views[owned.view] = owned
    if not _hooks_installed:
        register_optimizer_step_pre_hook(_step_on_owned_ranges)
        register_optimizer_step_post_hook(_gather_after_step)
        _hooks_installed = True


def is_zero1(parameter: torch.Tensor) -> bool:
    return parameter in _owned


def whole_of(parameter: torch.Tensor) -> torch.Tensor:
    """The whole parameter a zero1 range views (any other tensor: itself)."""
    owned = _views.get(parameter)
    return owned.whole if owned is not None else parameter


_switched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _step_on_owned_ranges(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer not in _switched and any(p in _owned for g in optimizer.param_groups for p in g["params"]):
        for group in optimizer.param_groups:
            group["params"] = [_owned[p].view if p in _owned else p for p in group["params"]]
        optimizer.zero_grad = _clearing_whole_gradients(optimizer)  # type: ignore[method-assign]
        _switched.add(optimizer)
    for group in optimizer.param_groups:
        for view in group["params"]:
            owned = _views.get(view)
            if owned is not None:
                grad = owned.whole.grad
                view.grad = None if grad is None else grad.reshape(-1)[owned.lo : owned.hi]


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


def _gather_after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Every rank's stepped range into the whole parameters (the whole gradients stay, as DDP's do)."""
    stepped = [_views[v] for group in optimizer.param_groups for v in group["params"] if v in _views]
    for owned in stepped:
        owned.view.grad = None  # a view of the whole gradient, made again before each step
    by_dtype: dict[tuple[torch.dtype, dist.ProcessGroup], list[Owned]] = {}
    for owned in stepped:
        by_dtype.setdefault((owned.whole.dtype, owned.group), []).append(owned)
    with torch.no_grad():
        for (_, group), owned in by_dtype.items():
            _all_gather_ranges(owned, group)


def _all_gather_ranges(owned: list[Owned], group: dist.ProcessGroup) -> None:
    """One all-gather: each rank sends its ranges, each padded to ceil(numel / N), back to back."""
    world_size = dist.get_world_size(group)
    chunks = [-(-o.whole.numel() // world_size) for o in owned]
    mine = torch.cat([torch.nn.functional.pad(o.view.detach(), (0, c - o.view.numel())) for o, c in zip(owned, chunks)])
    gathered = mine.new_empty(world_size * mine.numel())
    dist.all_gather_into_tensor(gathered, mine, group=group)
    for o, piece in zip(owned, gathered.view(world_size, -1).split(chunks, dim=1)):
        o.whole.detach().view(-1).copy_(piece.reshape(-1)[: o.whole.numel()])
