"""How each parallel strategy plugs into ``explain``: what one rank holds at rest, how its model is placed.

A strategy's passes run inside the backend; what inspection needs from it beyond the graphs is
which kinds of state one rank holds only a dim-0 shard of over the whole world (see [Note: what a
rank's memory counts] in ``memory.py``), or that rank 0's own tensors must be read instead, and
the model's placement before compiling, run inside the simulated world. The first follows from
the strategy's mesh axes (core/plan.py); the placement is ``dpar.parallelize``, which the api hands
down (``Parallelize``): inspection sits below the api and does not import it. Adding a strategy is
adding an entry to ``STRATEGIES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dpar.core.errors import InspectionError, OptionsError
from dpar.core.plan import Strategy

Parallelize = Callable[..., torch.nn.Module]  # dpar.parallelize


@dataclasses.dataclass(frozen=True)
class InspectedStrategy:
    name: str
    strategy: Strategy | None  # None: auto, the planner chooses
    extra: tuple[tuple[str, Any], ...] = ()  # further keywords of parallelize (tp+sp: sequence_parallel)

    @property
    def local_state(self) -> bool:
        """Memory at rest is read off rank 0's own tensors (a tensor-parallel block, its experts, an hsdp or 2-D shard),
        not from a formula in N over the whole world."""
        return (self.strategy is None or self.strategy.tensor_parallel or self.strategy.expert_parallel
                or len(self.strategy.roles) > 1)

    @property
    def shards_parameters(self) -> bool:
        """At rest, over the whole world (dpar's zero2 keeps shards of everything at rest, like fsdp; the two
        differ in how long gathered parameters live during the step, which the graphs show)."""
        return self.strategy is not None and self.strategy.shards_parameters and not self.local_state

    shards_gradients = shards_optimizer = shards_parameters

    @property
    def takes_bucket_cap(self) -> bool:
        """parallelize lays out its buckets, so ``bucket_cap_mb`` goes to it, not to the compile options."""
        return self.strategy is not None and self.strategy.buckets_laid_out_by == "parallelize"

    @property
    def reduces_gradients(self) -> bool:
        """Its backward must reduce gradients over data-parallel ranks or the cp axis (tp alone need not)."""
        return self.strategy is not None and (self.strategy.data_parallel is not None or self.strategy.context_parallel)

    def prepare(
        self, model: torch.nn.Module, example_inputs: Sequence[Any], world_size: int, bucket_cap_mb: float | None,
        parallelize: Parallelize | None,
    ) -> torch.nn.Module:
        """``parallelize`` as a user would call it, on a copy inside the simulated world: 2-D strategies on a
        ``(world / 2, 2)`` mesh named as the strategy names its axes, 3-D ones on ``(world / 4, 2, 2)``; tensor-parallel ones (and auto) planned
        from the example inputs. ddp needs no placement."""
        if self.strategy is Strategy.DDP:  # unless a policy to attach rides with parallelize (api/explaining.py)
            return parallelize(model, strategy="ddp") if getattr(parallelize, "places_ddp", False) else model
        name = "auto" if self.strategy is None else self.strategy.value
        if parallelize is None:
            raise InspectionError(
                f"dpar.inspect's explain: strategy {self.name!r} places the model with dpar.parallelize, which the "
                "api hands down: call dpar.explain(...) with the same arguments"
            )
        from torch.distributed.device_mesh import init_device_mesh

        extra = dict(self.extra)
        if self.strategy is not None and len(self.strategy.roles) > 1:
            inner = 2 ** (len(self.strategy.roles) - 1)  # 2 ranks on each axis after the first
            if world_size % inner:
                raise OptionsError(f"dpar.explain: {name!r} simulates a ({world_size} / {inner}, "
                                   f"{', '.join(['2'] * (len(self.strategy.roles) - 1))}) mesh; choose a world size "
                                   f"divisible by {inner}")
            shape = (world_size // inner,) + (2,) * (len(self.strategy.roles) - 1)
            extra["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=self.strategy.mesh_dim_names)
        if self.strategy is None or self.strategy.tensor_parallel:
            extra["example_inputs"] = example_inputs
        if bucket_cap_mb is not None:
            extra["bucket_cap_mb"] = bucket_cap_mb
        return parallelize(model, strategy=name, **extra)


STRATEGIES: dict[str, InspectedStrategy] = {
    **{s.value: InspectedStrategy(s.value, s) for s in (Strategy.DDP, Strategy.ZERO2, Strategy.FSDP, Strategy.HSDP, Strategy.TP)},
    "tp+sp": InspectedStrategy("tp+sp", Strategy.TP, (("sequence_parallel", True),)),
    **{s.value: InspectedStrategy(s.value, s) for s in (Strategy.DDP_TP, Strategy.ZERO2_TP, Strategy.FSDP_TP)},
    **{s.value: InspectedStrategy(s.value, s) for s in (Strategy.EP, Strategy.DDP_EP, Strategy.ZERO2_EP, Strategy.FSDP_EP)},
    **{s.value: InspectedStrategy(s.value, s) for s in (Strategy.CP, Strategy.DDP_CP, Strategy.ZERO2_CP, Strategy.FSDP_CP)},
    **{s.value: InspectedStrategy(s.value, s)
       for s in (Strategy.CP_TP, Strategy.DDP_CP_TP, Strategy.ZERO2_CP_TP, Strategy.FSDP_CP_TP)},
    "auto": InspectedStrategy("auto", None),
}


def strategy(name: str) -> InspectedStrategy:
    if name not in STRATEGIES:
        raise OptionsError(
            f"dpar.explain: strategy {name!r} is not available for inspection yet; "
            f"choose one of {sorted(STRATEGIES)}"
        )
    return STRATEGIES[name]
