"""zero1's surgery: each trained parameter's range this rank's optimizer steps, recorded by name.

The optimizer switches to views of those ranges at its first step (runtime/zero1.py, where [Note: how zero1
shards the optimizer] is); here only the ranges are decided, at ``parallelize`` (on meta too) and again at
each compile, for a model materialized since (``to_empty``, ``load_state_dict(assign=True)``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
import torch.nn as nn

from dpar.core import model_state
from dpar.core.errors import OptionsError
from dpar.core.facts import ZERO1, Range


def owned_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of a parameter's flattened elements that ``rank`` steps: ranges of ceil(numel / N)."""
    chunk = -(-numel // world_size)
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def shard_optimizer_state(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Record each trained parameter's range for this rank; optimizers switch to views of them at their first step."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    parameters = [p for p in parameters if p.requires_grad]
    for p, owner in zip(parameters, model_state.owners_of(parameters)):
        if owner is None:
            raise OptionsError("zero1's parameters must belong to a model dpar.parallelize was called on")
        for name in owner.names_of(p):
            if name not in owner.facts(ZERO1):
                lo, hi = owned_range(p.numel(), world_size, rank)
                owner.set_fact(ZERO1, name, Range(lo, hi, p.numel(), group))
