"""An optimizer's step captured by Dynamo as a graph, so that passes can add to it.

[Note: capturing an optimizer's step]
``torch.compile`` captures ``Optimizer.step``: the parameters and their state become
attributes of the graph (``get_attr``), their gradients its inputs, and the update
a sequence of in-place ops on them. Two wrappers are left out of the capture:
the hook wrapper ``Optimizer`` puts around every ``step`` (its pre- and post-hooks
keep running around the captured step, see ``runtime/zero1.py``), and
``_use_grad_for_differentiable``, whose graph breaks only toggle grad mode: the
captured body runs under ``no_grad`` (``differentiable=True`` is refused). With
``fullgraph=True`` a step Dynamo cannot capture whole raises at once instead of
running in pieces, some of them eager. Each captured step compiles a copy of the
step function's code, so each optimizer has its own Dynamo cache: many optimizers
of one class do not share, and exhaust, one recompile limit. A graph runs as
Python: on CPU this costs more than the eager step for many small parameters
(about 6 us per op, see the README's zero1 section). Should Dynamo run a step
eagerly all the same (``torch.compiler.disable``, ``set_stance("force_eager")``),
``ran`` stays False, and the caller runs the same passes over a graph that only
reads the parameters (``after_uncaptured``).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.exc import FailOnRecompileLimitHit, Unsupported
from torch.optim.optimizer import _use_grad_for_differentiable

from dpar.compiler.collectives import collectives
from dpar.compiler.pipeline import Pass, run_passes
from dpar.compiler.registry import record
from dpar.runtime.errors import OptionsError

PassesFor = Callable[[Sequence[Any]], list[Pass]]
"""The passes for a step graph, given its example inputs (to match graph inputs to tensors)."""

LABEL = "optimizer step graph"
_USE_GRAD = _use_grad_for_differentiable(lambda: None).__code__


def _step_body(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The class's step without the hook and grad-mode wrappers, as a function with its own code object."""
    step = type(optimizer).step
    step = getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step
    if step.__code__ is _USE_GRAD:
        step = step.__wrapped__
    body = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__, step.__closure__)
    body.__kwdefaults__ = step.__kwdefaults__
    return body


class CapturedStep:
    """``optimizer``'s step, each graph Dynamo captures of it through ``passes``."""

    def __init__(self, optimizer: torch.optim.Optimizer, passes: PassesFor) -> None:
        if optimizer.defaults.get("differentiable", False):
            raise OptionsError(
                f"{type(optimizer).__name__}(differentiable=True) cannot be captured, and zero1 gathers the "
                "stepped parameters inside the captured step: build the optimizer with differentiable=False"
            )
        self._optimizer, self.passes = weakref.ref(optimizer), passes  # zero1 keys its steps by optimizer, weakly
        self.ran = False  # whether the last call ran a captured graph (Dynamo may run a frame eagerly)
        self._gather_only: fx.GraphModule | None = None
        self._compiled = torch.compile(_step_body(optimizer), backend=self._backend, fullgraph=True)

    def _backend(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        gm = run_passes(gm, self.passes(example_inputs), LABEL)
        record(LABEL, gm, collectives(gm))

        def run(*args: Any) -> Any:
            self.ran = True
            return gm(*args)

        return run

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        optimizer = self._optimizer()
        assert optimizer is not None, "a captured step lives no longer than its optimizer"
        return optimizer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One step (``args`` as ``optimizer.step`` takes them, without self)."""
        if args or kwargs.get("closure") is not None:
            raise OptionsError(
                f"{type(self.optimizer).__name__}.step(closure) re-evaluates the loss inside the step, which cannot be "
                "captured, and zero1 gathers the stepped parameters inside the captured step: call loss.backward() "
                "and then optimizer.step() without a closure"
            )
        self.ran = False
        try:
            with torch.no_grad():
                return self._compiled(self.optimizer)
        except (Unsupported, FailOnRecompileLimitHit) as exc:
            reason = str(exc).strip().splitlines()[0]
            raise OptionsError(
                f"zero1 captures the optimizer's step with torch.compile(fullgraph=True) and appends the all-gather "
                f"of the stepped ranges to it; Dynamo cannot capture {type(self.optimizer).__name__}'s step: {reason}. "
                "Use an optimizer Dynamo captures (SGD, Adam, AdamW, ...), or strategy='ddp' or 'zero2'"
            ) from exc

    def after_uncaptured(self) -> None:
        """The passes over a graph that only reads the optimizer's parameters, for a step Dynamo did not capture."""
        if self._gather_only is None:
            holder, graph = nn.Module(), fx.Graph()
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            for i, p in enumerate(params):
                setattr(holder, f"p{i}", p)
                graph.get_attr(f"p{i}")
            graph.output(())
            label = f"{LABEL} (gather only)"
            self._gather_only = run_passes(fx.GraphModule(holder, graph), self.passes(()), label)
            record(label, self._gather_only, collectives(self._gather_only))
        with torch.no_grad():
            self._gather_only()
