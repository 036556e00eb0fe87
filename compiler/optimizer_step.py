"""An optimizer's step captured by Dynamo as a graph, so that passes can add to it.

[Note: capturing an optimizer's step]
``torch.compile`` captures ``Optimizer.step``: the parameters and their state become
attributes of the graph (``get_attr``), their gradients its inputs, and the update
a sequence of in-place ops on them. Two wrappers are left out of the capture:
the hook wrapper ``Optimizer`` puts around every ``step`` (its pre- and post-hooks
keep running around the captured step, see ``runtime/optimizer_hooks.py``), and
``_use_grad_for_differentiable``, whose graph breaks only toggle grad mode: the
captured body runs under ``no_grad`` (``differentiable=True`` is refused). With
``fullgraph=True`` a step Dynamo cannot capture whole raises at once instead of
running in pieces, some of them eager (``StepNotCaptured``: the caller decides
whether that is an error or a reason to step eagerly). Each captured step
compiles a copy of the step function's code, so each optimizer has its own Dynamo
cache: many optimizers of one class do not share, and exhaust, one recompile
limit. After the passes the graph is lowered by ``lower``: run as Python, which
on CPU costs more than the eager step for many small parameters (about 6 us per
op), or compiled by Inductor (``inductor_step``), which fuses the update of every
parameter into a few loops, as ``torch.compile(optimizer.step)`` does, with the
same numbers bit for bit. Should Dynamo run a step eagerly all the same
(``torch.compiler.disable``, ``set_stance("force_eager")``), ``ran`` stays False,
and the caller runs the same passes over a graph that only reads the parameters
(``PassesAfterEagerStep``), as it does after a step it chose to run eagerly.

This is the pass listing's "optimizer" stage. The runtime's optimizer hooks decide when a step is
captured and which runs; they reach this module only through ``OptimizerStage``, which the backend
hands down on each compiled model's ``ModelState`` (``runtime/optimizer_hooks.py``), so the runtime
imports no compiler module.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from dpar.compiler.collectives import collectives
from dpar.compiler.pass_listing import Pass, optimizer_passes, run_passes
from dpar.compiler.passes.all_gather_ranges import UpdatedRange
from dpar.compiler.passes.gloo_all_gathers import as_run_on_gloo
from dpar.compiler.registry import record
from dpar.core.errors import StepNotCaptured
from dpar.core.plan import Strategy
from dpar.core.torch_internals import FailOnRecompileLimitHit, Unsupported, inductor, use_grad_for_differentiable
from dpar.runtime.optimizer_graph import unhooked

PassesFor = Callable[[Sequence[Any]], list[Pass]]
"""The passes for a step graph, given its example inputs (to match graph inputs to tensors)."""
StepLower = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]
"""What runs a step graph after its passes: its Python code, or Inductor's kernels."""

LABEL = "optimizer step graph"
_USE_GRAD = use_grad_for_differentiable(lambda: None).__code__


def _step_body(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The class's step without the hook and grad-mode wrappers, as a function with its own code object."""
    step = unhooked(optimizer)
    if step.__code__ is _USE_GRAD:
        step = step.__wrapped__
    # A copy of the code object: Dynamo caches per code object, and each optimizer needs its own cache (no public way).
    body = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__, step.__closure__)
    body.__kwdefaults__ = step.__kwdefaults__
    return body


def python_step(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    return gm


def inductor_step(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Inductor's kernels for a step graph. Dynamo's compile id comes off first: AOTAutograd reads a
    graph with one as Dynamo's and looks up a source for every attribute, which the tensors a pass
    added (zero1's whole parameters) do not have."""
    gm.meta.pop("dynamo_compile_id", None)
    return inductor().compile_fx(gm, example_inputs)


class CapturedStep:
    """``optimizer``'s step, each graph Dynamo captures of it through ``passes``, then ``lower``."""

    def __init__(self, optimizer: torch.optim.Optimizer, passes: PassesFor, lower: StepLower = python_step) -> None:
        if optimizer.defaults.get("differentiable", False):
            raise StepNotCaptured(optimizer, "differentiable=True steps under autograd, a captured step under no_grad")
        self._optimizer, self.passes, self.lower = weakref.ref(optimizer), passes, lower
        self.ran = False  # whether the last call ran a captured graph (Dynamo may run a frame eagerly)
        self._compiled = torch.compile(_step_body(optimizer), backend=self._backend, fullgraph=True)

    def _backend(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        gm = run_passes(gm, self.passes(example_inputs), LABEL)
        record(LABEL, gm, collectives(gm))
        compiled = self.lower(as_run_on_gloo(gm), example_inputs)  # [Note: no all-gather on gloo]

        def run(*args: Any) -> Any:
            self.ran = True
            return compiled(*args)

        return run

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        optimizer = self._optimizer()
        assert optimizer is not None, "a captured step lives no longer than its optimizer"
        return optimizer

    def __call__(self) -> Any:
        """One step; ``StepNotCaptured`` where Dynamo cannot capture it whole."""
        self.ran = False
        try:
            with torch.no_grad():
                return self._compiled(self.optimizer)
        except (Unsupported, FailOnRecompileLimitHit) as exc:
            raise StepNotCaptured(self.optimizer, str(exc).strip().splitlines()[0]) from exc


class PassesAfterEagerStep:
    """The passes over a graph that only reads an optimizer's parameters: what they add to a captured step
    (zero1's gather of the stepped ranges), for a step that ran eagerly instead. Built at the first call."""

    def __init__(self, optimizer: torch.optim.Optimizer, passes: PassesFor) -> None:
        self._optimizer, self.passes = weakref.ref(optimizer), passes
        self._graph: fx.GraphModule | None = None

    def __call__(self) -> None:
        if self._graph is None:
            optimizer = self._optimizer()
            assert optimizer is not None, "the passes after a step live no longer than its optimizer"
            holder, graph = nn.Module(), fx.Graph()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for i, p in enumerate(params):
                setattr(holder, f"p{i}", p)
                graph.get_attr(f"p{i}")
            graph.output(())
            label = f"{LABEL} (gather only)"
            gathering = run_passes(fx.GraphModule(holder, graph), self.passes(()), label)
            record(label, gathering, collectives(gathering))
            self._graph = as_run_on_gloo(gathering)
        with torch.no_grad():
            self._graph()


class OptimizerStage:
    """The "optimizer" stage as the runtime calls it (``core.model_state.OptimizerStage``): a step captured
    through the stage's passes and compiled by Inductor, and the same passes alone after an eager step."""

    def capture(
        self, optimizer: torch.optim.Optimizer, ranges: Sequence[UpdatedRange] = (), group: tuple[str, int] = ("", 1)
    ) -> CapturedStep:
        return CapturedStep(optimizer, _passes(ranges, group), inductor_step)

    def after_eager(
        self, optimizer: torch.optim.Optimizer, ranges: Sequence[UpdatedRange], group: tuple[str, int]
    ) -> PassesAfterEagerStep:
        return PassesAfterEagerStep(optimizer, _passes(ranges, group))


def _passes(ranges: Sequence[UpdatedRange], group: tuple[str, int]) -> PassesFor:
    """zero1's gather of the stepped ranges where there are ranges; no pass otherwise."""
    if not ranges:
        return lambda inputs: []
    return lambda inputs: optimizer_passes(Strategy.ZERO1, ranges, inputs, group)


OPTIMIZER_STAGE = OptimizerStage()
