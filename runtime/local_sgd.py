"""Local SGD while training: the forward variant each call runs, from where the model is in its period.

[Note: when local SGD averages]
Every rank steps its own replica on its own rows, with no gradient
communication. After every ``sync_every`` optimizer steps the replicas are
averaged: the forward that follows the H-th step runs a variant whose first
collective averages the parameters and writes the averages back. A step is a
forward outside ``no_sync`` (the micro-batches inside it accumulate into the same
step), so accumulation does not shift the period; the averaging forward may be
the first micro-batch of a step. With plain SGD and ``sync_every=1`` every forward
sees DDP's parameters of that step: the average of the replicas' SGD steps from
one common point is the step on the average gradient. The period's position is
saved with ``dpar.checkpoint`` so a resumed run averages where the uninterrupted
one would. The ``Period`` is a fact of the model (``core/facts.py``), attached by
``parallelize`` (surgery/local_sgd.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dpar.core.facts import Period
from dpar.runtime.gradient_sync import inside_no_sync


def choose_variant(
    period: Period,
    parameters: list[Callable[[], torch.Tensor | None]],
    trained: list[Callable[[], torch.Tensor | None]],
) -> Callable[[], tuple[bool, list[torch.Tensor]]]:
    """For ``ForwardDispatch``: whether this forward averages, and the extra inputs it then takes
    (DiLoCo's anchors and momenta; the anchors are the replicas as the first forward finds them)."""

    def choose() -> tuple[bool, list[torch.Tensor]]:
        live = [p for p in (ref() for ref in parameters) if p is not None]
        outer = period.outer_state([ref() for ref in trained]) if period.outer is not None else []
        average = period.next_forward(accumulating=inside_no_sync(live))
        return average, outer if average else []

    return choose
