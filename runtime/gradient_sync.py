"""When gradients are communicated: ``no_sync`` and the backward variant chosen per call.

[Note: gradient accumulation in a graph world]
A compiled backward sees only this micro-batch's gradient; autograd adds it into
``param.grad`` after the graph returns. Under ``no_sync`` the backward runs
without collectives and gradients accumulate locally, as in DDP. The next
synchronising backward must average the accumulated *total*, so it runs a
variant of the graph that takes the local ``param.grad`` as extra inputs, adds
them before the reduction, and clears ``param.grad`` so that autograd stores
the averaged total instead of adding to the stale local sum. A parameter whose
accumulated gradient a graph consumed is no longer pending, so a second graph
touching the same (tied) parameter in the same backward reduces only its own
contribution.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch


class Variant(enum.Enum):
    SYNC = "sync"
    NO_SYNC = "no_sync"
    SYNC_ACCUMULATED = "sync_accumulated"


# Marks on the parameters, not tables keyed by them (swap_tensors refuses a tensor any weak reference points
# at): how many no_sync blocks hold one now, and whether its .grad holds a local sum not yet averaged. A swap
# moves both marks with the gradient they describe.
_NO_SYNC = "_dpar_no_sync"
_PENDING = "_dpar_pending_local_grad"


@contextlib.contextmanager
def no_sync(model: torch.nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients locally; the next one outside averages the total."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        setattr(p, _NO_SYNC, getattr(p, _NO_SYNC, 0) + 1)
    try:
        yield
    finally:
        for p in params:
            setattr(p, _NO_SYNC, getattr(p, _NO_SYNC) - 1)


def inside_no_sync(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether a ``no_sync`` block holds any of ``parameters`` now."""
    return any(getattr(p, _NO_SYNC, 0) > 0 for p in parameters)


class _Variants:
    """A graph compiled in variants, each built on first use; the call a subclass's ``__call__`` picks runs."""

    def __init__(self, build: Callable[[Any], Callable[..., Any]]) -> None:
        # An instance attribute: AOTAutograd reads it through a functools.wraps copy of __dict__.
        self._boxed_call = True
        self._build = build
        self._variants: dict[Any, Callable[..., Any]] = {}
        self.calls: dict[Any, int] = {}

    def prepare(self, variant: Any) -> Callable[..., Any]:
        """Build ``variant`` now (the first call of each variant builds it otherwise)."""
        if variant not in self._variants:
            self._variants[variant] = self._build(variant)
        return self._variants[variant]

    def _run(self, variant: Any, args: list[Any]) -> Any:
        self.calls[variant] = self.calls.get(variant, 0) + 1
        return self.prepare(variant)(args)


class BackwardDispatch(_Variants):
    """The backward callable AOTAutograd runs: picks and lazily builds the variant this call needs.

    ``accumulated_order`` lists, by forward-input index, the parameters whose
    local gradients the SYNC_ACCUMULATED variant takes as extra inputs.
    """

    def __init__(
        self,
        parameters: dict[int, Callable[[], torch.Tensor | None]],
        accumulated_order: Sequence[int],
        build: Callable[[Variant], Callable[..., Any]],
    ) -> None:
        super().__init__(build)
        self._parameters = parameters
        self._accumulated_order = list(accumulated_order)
        self.calls = {v: 0 for v in Variant}

    def __call__(self, args: list[Any]) -> Any:
        params = {i: ref() for i, ref in self._parameters.items()}
        live = [p for p in params.values() if p is not None]
        if inside_no_sync(live):
            for p in live:
                setattr(p, _PENDING, True)
            return self._run(Variant.NO_SYNC, args)
        pending = {
            i
            for i in self._accumulated_order
            if params[i] is not None and getattr(params[i], _PENDING, False) and params[i].grad is not None
        }
        for p in live:
            if getattr(p, _PENDING, False):
                setattr(p, _PENDING, False)
        if not pending:
            return self._run(Variant.SYNC, args)
        accumulated = []
        for i in self._accumulated_order:
            p = params[i]
            if i in pending:
                accumulated.append(p.grad)
                p.grad = None
            else:
                accumulated.append(torch.zeros_like(p))
        return self._run(Variant.SYNC_ACCUMULATED, [*args, *accumulated])


class ForwardDispatch(_Variants):
    """The forward callable AOTAutograd runs where a strategy has two forwards: ``choose()`` says,
    each call, whether this one runs the other variant and which extra inputs that takes (local
    SGD's averaging forward)."""

    def __init__(self, choose: Callable[[], tuple[bool, list[torch.Tensor]]], build: Callable[[bool], Callable[..., Any]]) -> None:
        super().__init__(build)
        self._choose = choose
        self.calls = {False: 0, True: 0}

    def __call__(self, args: list[Any]) -> Any:
        other, extra = self._choose()
        return self._run(other, [*args, *extra])
