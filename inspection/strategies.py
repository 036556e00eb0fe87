"""How each parallel strategy plugs into ``explain``: what it shards at rest, how it prepares a model.

A strategy's passes run inside the backend; what inspection needs from it
beyond the graphs is which kinds of state one rank holds only a dim-0 shard of
(see [Note: what a rank's memory counts] in ``memory.py``), and any preparation
of the model before compiling, run inside the simulated world. Adding a
strategy is adding an entry to ``STRATEGIES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dpar.core.errors import OptionsError


Prepare = Callable[[torch.nn.Module, Sequence[Any], int, "float | None"], torch.nn.Module]


def _unchanged(model: torch.nn.Module, example_inputs: Sequence[Any], world_size: int, bucket_cap_mb: float | None) -> torch.nn.Module:
    return model


def _parallelized(strategy: str, *, mesh_names: tuple[str, str] | None = None, **kwargs: Any) -> Prepare:
    """``dpar.parallelize`` as a user would call it, inside the simulated world: 2-D strategies on a
    ``(world / 2, 2)`` mesh named ``mesh_names``; tensor-parallel ones planned from the example inputs."""

    def prepare(model: torch.nn.Module, example_inputs: Sequence[Any], world_size: int, bucket_cap_mb: float | None) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        from dpar.placement import parallelize  # the api layer; imported late, it imports the runtime

        extra = dict(kwargs)
        if mesh_names is not None:
            if world_size % 2:
                raise OptionsError(f"dpar.explain: {strategy!r} simulates a ({world_size} / 2, 2) mesh; choose an even world size")
            extra["mesh"] = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=mesh_names)
        if "tp" in strategy or strategy == "auto":
            extra["example_inputs"] = example_inputs
        if bucket_cap_mb is not None:
            extra["bucket_cap_mb"] = bucket_cap_mb
        return parallelize(model, strategy=strategy, **extra)

    return prepare


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    shards_parameters: bool = False  # at rest, over the whole world; gathered parameters are counted from the graphs
    shards_gradients: bool = False
    shards_optimizer: bool = False
    prepare: Prepare = _unchanged
    """Applied to a copy of the model inside the simulated world, before compiling; a strategy that
    shards parameters takes ``bucket_cap_mb`` here (parallelize's knob), not as a compile option."""
    takes_bucket_cap: bool = False  # parallelize lays out its buckets
    local_state: bool = False
    """Memory at rest is read off rank 0's own tensors (a tensor-parallel block, an hsdp or 2-D shard),
    not from a formula in N over the whole world."""


STRATEGIES: dict[str, Strategy] = {
    # DDP replicates everything: nothing per rank shrinks with N.
    "ddp": Strategy("ddp"),
    # dpar's zero2 keeps shards of everything at rest, like fsdp; the two differ in how
    # long gathered parameters live during the step, which the graphs show.
    "zero2": Strategy("zero2", True, True, True, _parallelized("zero2"), takes_bucket_cap=True),
    "fsdp": Strategy("fsdp", True, True, True, _parallelized("fsdp"), takes_bucket_cap=True),
    "hsdp": Strategy("hsdp", prepare=_parallelized("hsdp", mesh_names=("replicate", "shard")), takes_bucket_cap=True, local_state=True),
    "tp": Strategy("tp", prepare=_parallelized("tp"), local_state=True),
    "tp+sp": Strategy("tp+sp", prepare=_parallelized("tp", sequence_parallel=True), local_state=True),
    "ddp+tp": Strategy("ddp+tp", prepare=_parallelized("ddp+tp", mesh_names=("dp", "tp")), local_state=True),
    "zero2+tp": Strategy("zero2+tp", prepare=_parallelized("zero2+tp", mesh_names=("dp", "tp")), takes_bucket_cap=True, local_state=True),
    "fsdp+tp": Strategy("fsdp+tp", prepare=_parallelized("fsdp+tp", mesh_names=("dp", "tp")), takes_bucket_cap=True, local_state=True),
    "auto": Strategy("auto", prepare=_parallelized("auto"), local_state=True),
}


def strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise OptionsError(
            f"dpar.explain: strategy {name!r} is not available for inspection yet; "
            f"choose one of {sorted(STRATEGIES)}"
        )
    return STRATEGIES[name]
