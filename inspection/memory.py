"""Per-rank memory: parameters, gradients, optimizer state, gathered parameters and activations.

[Note: what a rank's memory counts]
At rest, a strategy either replicates a kind of state (all of it on every rank)
or shards it on dim 0 with ``torch.chunk`` semantics, as DTensor's ``Shard(0)``
does: rank 0 holds ``ceil(d0 / N)`` rows, the most any rank holds, so the
sharded bytes below are rank 0's, padding included (with d0 < N, ranks past d0
hold nothing and rank 0 still holds a row). Gradients are the stored ones (the
shard a reduce-scatter returns); optimizer state is OPTIMIZER_STATES tensors of
each trainable parameter's held size (Adam's scalar ``step`` is not counted).
Where state is split over one mesh dimension only (hsdp, tensor parallel and
the 2-D strategies), rank 0's own tensors are counted: a number, not a formula
in N.

During the step, graph intermediates come on top: the live bytes of the
step's graphs at their peak (``step_peak``, [Note: a step's live bytes] in
``compiler/memory.py``), split into gathered parameters and activations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import sympy
import torch
from torch.distributed.tensor import DTensor

from dpar.compiler.costs import N
from dpar.compiler.memory import OPTIMIZER_STATES, Live
from dpar.inspect.strategies import InspectedStrategy

P, G, S, W, A = sympy.symbols("P G S W A", nonnegative=True)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one rank holds at the peak of a step (see [Note: what a rank's memory counts])."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int  # full parameters gathered from shards, live at the peak
    activations: int  # the other live intermediate tensors at the peak (estimate)
    formula: sympy.Expr  # total bytes as a function of N, padding included (W, A as at this N)
    symbolic: sympy.Expr  # the same in P, G, S, W, A and N, padding aside
    step_peak: int = 0
    """The most bytes the step's graphs hold at once above the state a rank keeps between steps:
    gathered parameters, activations and the gradients produced by then ([Note: gradients live to
    the optimizer] in compiler/memory.py). What a rank measures above its bytes at the step's start."""
    phase_peaks: tuple[tuple[int, int], ...] = ()
    """(gathered, activations) at the forward graphs' peak and at the backward graphs' (``Live.phases``)."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations

    def total_at(self, world_size: int) -> int:
        return int(self.formula.subs(N, world_size))


def held_bytes(param: torch.Tensor, sharded: bool, local: bool = False) -> sympy.Expr:
    """Bytes of ``param`` rank 0 holds, in N: all of it, or its ``ceil(d0 / N)`` rows; with ``local``,
    what rank 0's own tensor holds (a tensor-parallel block, a shard over one mesh dimension)."""
    if local:
        held = param.to_local() if isinstance(param, DTensor) else param
        return sympy.Integer(held.numel() * held.element_size())
    shape = tuple(param.shape)  # a DTensor's is the global shape
    if not sharded:
        return sympy.Integer(math.prod(shape) * param.element_size())
    row_bytes = math.prod(shape[1:]) * param.element_size()
    return sympy.ceiling(sympy.Integer(shape[0]) / N) * row_bytes


def per_rank_memory(
    parameters: Sequence[torch.nn.Parameter],
    strategy: InspectedStrategy,
    optimizer: str,
    peak: Live,
    world_size: int,
) -> Memory:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATES)}")
    trainable = [p for p in parameters if p.requires_grad]
    local = strategy.local_state
    param_bytes = sum(held_bytes(p, strategy.shards_parameters, local) for p in parameters)
    grad_bytes = sum(held_bytes(p, strategy.shards_gradients, local) for p in trainable)
    state_bytes = OPTIMIZER_STATES[optimizer] * sum(held_bytes(p, strategy.shards_optimizer, local) for p in trainable)
    formula = sympy.Integer(0) + param_bytes + grad_bytes + state_bytes + peak.gathered + peak.activations

    def share(sharded: bool) -> sympy.Expr:
        return 1 / N if sharded else sympy.Integer(1)

    symbolic = (
        share(strategy.shards_parameters) * P + share(strategy.shards_gradients) * G
        + share(strategy.shards_optimizer) * S + W + A
    )

    def at_n(expr: sympy.Expr) -> int:
        return int(sympy.sympify(expr).subs(N, world_size))

    return Memory(
        parameters=at_n(param_bytes),
        gradients=at_n(grad_bytes),
        optimizer=at_n(state_bytes),
        gathered=peak.gathered,
        activations=peak.activations,
        formula=formula,
        symbolic=symbolic,
        step_peak=max(peak.step, peak.total),
        phase_peaks=peak.phases,
    )
