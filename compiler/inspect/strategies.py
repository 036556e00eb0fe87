"""How each parallel strategy plugs into ``explain``: what it holds per rank, how it prepares a model.

A strategy's passes run inside the backend; what inspection needs from it
beyond the graphs is the fraction of each kind of state one rank keeps, as a
sympy expression in N, and any preparation of the model before compiling.
Adding a strategy is adding an entry to ``STRATEGIES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import sympy
import torch

from dpar.compiler.inspect.costs import N
from dpar.runtime.errors import OptionsError


def _unchanged(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    return model


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    parameters: sympy.Expr  # share of the parameters one rank holds
    gradients: sympy.Expr
    optimizer: sympy.Expr
    prepare: Callable[[torch.nn.Module, int], torch.nn.Module] = _unchanged
    """Applied to a copy of the model before compiling (dpar.parallelize for sharding strategies)."""


STRATEGIES: dict[str, Strategy] = {
    # DDP replicates everything: nothing per rank shrinks with N.
    "ddp": Strategy("ddp", sympy.Integer(1), sympy.Integer(1), sympy.Integer(1)),
}

assert all(s.parameters.free_symbols <= {N} for s in STRATEGIES.values())


def strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise OptionsError(
            f"dpar.explain: strategy {name!r} is not available for inspection yet; "
            f"choose one of {sorted(STRATEGIES)}"
        )
    return STRATEGIES[name]
