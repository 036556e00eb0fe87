"""Which gradients share an all-reduce: DDP's size-capped buckets, in readiness order.

Without ``bucket_cap_mb`` ddp plans them from cost instead (``bucket_schedule.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

BUCKET_REASON = "dpar_bucket_reason"  # node.meta key: on a bucket's all-reduce, its ``Bucket.reason``


@dataclasses.dataclass(frozen=True)
class Gradient:
    """A parameter gradient the backward graph returns."""

    output_index: int  # position in the backward outputs == forward input index
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    ready_at: int  # position of the node that produces it
    ready_s: float = 0.0  # seconds of backward compute done when it is produced (the cost model's)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Gradients flattened into one collective, in the order they were added."""

    index: int
    dtype: torch.dtype
    gradients: tuple[Gradient, ...]
    reason: str = ""  # why it closed where it did, for ``dpar inspect``

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.gradients)

    @property
    def ready_at(self) -> int:
        return max(g.ready_at for g in self.gradients)


def plan_buckets(gradients: Sequence[Gradient], cap_bytes: int) -> list[Bucket]:
    """Fill one open bucket per dtype in readiness order; close it once it reaches the cap.

    As in DDP a bucket may exceed the cap by its last gradient, so a gradient
    larger than the cap travels alone. Buckets come back in the order their last
    gradient is ready, which is the order their all-reduces can be issued.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    closed: list[list[Gradient]] = []
    open_by_dtype: dict[torch.dtype, list[Gradient]] = {}
    for grad in sorted(gradients, key=lambda g: (g.ready_at, g.output_index)):
        bucket = open_by_dtype.setdefault(grad.dtype, [])
        bucket.append(grad)
        if sum(g.nbytes for g in bucket) >= cap_bytes:
            closed.append(open_by_dtype.pop(grad.dtype))
    full = {id(b) for b in closed}
    closed.extend(open_by_dtype.values())
    closed.sort(key=lambda b: max(g.ready_at for g in b))
    return [
        Bucket(index=i, dtype=grads[0].dtype, gradients=tuple(grads), reason=_greedy_reason(grads, cap_bytes, id(grads) in full))
        for i, grads in enumerate(closed)
    ]


def _greedy_reason(grads: Sequence[Gradient], cap_bytes: int, full: bool) -> str:
    size = sum(g.nbytes for g in grads)
    if full:
        return f"bucket_cap_mb: DDP's rule, closed on reaching the {cap_bytes / 2**20:g} MiB cap ({size:,} bytes)"
    return f"bucket_cap_mb: DDP's rule, the last gradients ({size:,} bytes, under the {cap_bytes / 2**20:g} MiB cap)"
