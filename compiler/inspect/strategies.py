"""How each parallel strategy plugs into ``explain``: what it shards at rest, how it prepares a model.

A strategy's passes run inside the backend; what inspection needs from it
beyond the graphs is which kinds of state one rank holds only a dim-0 shard of
(see [Note: what a rank's memory counts] in ``memory.py``), and any preparation
of the model before compiling, run inside the simulated world. Adding a
strategy is adding an entry to ``STRATEGIES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from dpar.runtime.errors import OptionsError


def _unchanged(model: torch.nn.Module, bucket_cap_mb: float | None) -> torch.nn.Module:
    return model


def _parallelized(strategy: str) -> Callable[[torch.nn.Module, float | None], torch.nn.Module]:
    """``dpar.parallelize`` as a user would call it (per-block buckets unless a cap is given)."""

    def prepare(model: torch.nn.Module, bucket_cap_mb: float | None) -> torch.nn.Module:
        from dpar.placement import parallelize  # the api layer; imported late, it imports the runtime

        return parallelize(model, strategy=strategy, bucket_cap_mb=bucket_cap_mb)

    return prepare


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    shards_parameters: bool = False  # at rest; gathered parameters are counted from the graphs
    shards_gradients: bool = False
    shards_optimizer: bool = False
    prepare: Callable[[torch.nn.Module, float | None], torch.nn.Module] = _unchanged
    """Applied to a copy of the model inside the simulated world, before compiling; a strategy that
    shards parameters takes ``bucket_cap_mb`` here (parallelize's knob), not as a compile option."""


STRATEGIES: dict[str, Strategy] = {
    # DDP replicates everything: nothing per rank shrinks with N.
    "ddp": Strategy("ddp"),
    # dpar's zero2 keeps shards of everything at rest, like fsdp; the two differ in how
    # long gathered parameters live during the step, which the graphs show.
    "zero2": Strategy("zero2", True, True, True, _parallelized("zero2")),
    "fsdp": Strategy("fsdp", True, True, True, _parallelized("fsdp")),
}


def strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise OptionsError(
            f"dpar.explain: strategy {name!r} is not available for inspection yet; "
            f"choose one of {sorted(STRATEGIES)}"
        )
    return STRATEGIES[name]
