"""ddp's passes: rank 0's buffers into every forward, one averaged all-reduce per gradient bucket.

Which of them run, and in what order, is ``pass_listing.py``'s to say.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from dpar.compiler.capture import GraphInput, InputKind
from dpar.compiler.costs import DeviceSpec, comm_time, compute_done, spec_of_tensors
from dpar.compiler.options import DDP_BUCKET_CAP_MB
from dpar.compiler.passes.all_reduce import accumulated_gradient_order, all_reduce_gradients_pass
from dpar.compiler.passes.broadcast_buffers import broadcast_buffers_pass
from dpar.compiler.passes.bucket_schedule import schedule_buckets
from dpar.compiler.passes.buckets import Bucket, Gradient, plan_buckets
from dpar.core.plan import MeshAxis
from dpar.runtime.gradient_sync import Variant

log = logging.getLogger("dpar")

def gradients_of(
    gm: fx.GraphModule, inputs: Sequence[GraphInput], done: Mapping[fx.Node, float] | None = None
) -> list[Gradient]:
    """The parameter gradients a backward graph returns, with where each becomes ready (and, given
    ``compute_done``'s figures, after how many seconds of the backward's compute)."""
    outputs = gm.graph.output_node().args[0]
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = done or {}
    return [
        Gradient(
            output_index=inp.index,
            name=inp.name,
            shape=inp.shape,
            dtype=inp.dtype,
            ready_at=position[outputs[inp.index]],
            ready_s=done.get(outputs[inp.index], 0.0),
        )
        for inp in inputs
        if inp.kind is InputKind.PARAMETER and isinstance(outputs[inp.index], fx.Node)
    ]


def scheduled_buckets(
    backward: fx.GraphModule, inputs: Sequence[GraphInput], world_size: int, spec: DeviceSpec, cap_bytes: int
) -> list[Bucket]:
    """ddp's gradient buckets planned from cost on ``spec`` (see [Note: the bucket schedule])."""
    done = compute_done(backward, spec)
    return schedule_buckets(
        gradients_of(backward, inputs, done),
        backward_s=max(done.values(), default=0.0),
        all_reduce_s=lambda nbytes: comm_time("all_reduce", nbytes, world_size, spec),
        overlap=spec.overlap,
        cap_bytes=cap_bytes,
    )


def bucket_copy_bytes(backward: fx.GraphModule, inputs: Sequence[GraphInput], world_size: int, spec: DeviceSpec) -> int:
    """Bytes ddp's all-reduce pass reads and writes copying ``backward``'s gradients into its buckets at the default
    cap (``GradientBuckets.plan`` from cost, on ``spec``): a bucket of several gradients is flattened into one
    tensor, a non-contiguous gradient copied first; a bucket of one contiguous gradient is reduced in place."""
    buckets = scheduled_buckets(backward, inputs, world_size, spec, int(DDP_BUCKET_CAP_MB * 2**20))
    outputs = backward.graph.output_node().args[0]
    copied = 0
    for bucket in buckets:
        for grad in bucket.gradients:
            value = outputs[grad.output_index].meta.get("val")
            copied += 2 * grad.nbytes * ((len(bucket.gradients) > 1) + (value is not None and not value.is_contiguous()))
    return copied


def broadcast_buffers(gm: fx.GraphModule, groups: dict[str, list[int]]) -> fx.GraphModule:
    """DDP's broadcast_buffers: each group of ``buffer_broadcast_groups`` from its rank 0, in turn."""
    for group, positions in groups.items():
        gm = broadcast_buffers_pass(gm, positions, group_name=group)
    return gm


class GradientBuckets:
    """ddp's gradient buckets, planned from the backward graph: from cost under ``cap_bytes`` (see [Note: the
    bucket schedule]), or with ``from_cost=False`` (the user set ``bucket_cap_mb``) by DDP's greedy rule, as a
    DDP user setting it expects. ``groups`` pairs parameters with the axis their gradients average over: one
    group under ddp (the replicate axis); under ddp+ep the experts' blocks over "dp" and the rest over the world."""

    def __init__(self, groups: Sequence[tuple[Sequence[GraphInput], MeshAxis]], cap_bytes: int, *,
                 from_cost: bool = True) -> None:
        self.groups = [(list(inputs), axis) for inputs, axis in groups]
        self.cap_bytes, self.from_cost = cap_bytes, from_cost
        self.buckets: list[list[Bucket]] = [[] for _ in self.groups]  # per group

    def plan(self, backward: fx.GraphModule) -> None:
        for index, (inputs, axis) in enumerate(self.groups):
            if self.from_cost:
                spec = spec_of_tensors(i.tensor() for i in inputs if i.kind is InputKind.PARAMETER)
                self.buckets[index] = scheduled_buckets(backward, inputs, axis.size, spec, self.cap_bytes)
            else:
                self.buckets[index] = plan_buckets(gradients_of(backward, inputs), self.cap_bytes)
            log.info(
                "buckets over %s: %s", axis.name,
                [(b.index, str(b.dtype), b.nbytes, [g.name for g in b.gradients], b.reason) for b in self.buckets[index]],
            )

    @property
    def accumulation_order(self) -> list[int]:
        """Backward outputs whose accumulated gradients a ``SYNC_ACCUMULATED`` backward takes as inputs (group
        after group, as ``all_reduce`` appends their inputs)."""
        return [i for buckets in self.buckets for i in accumulated_gradient_order(buckets)]

    def all_reduce(self, gm: fx.GraphModule, variant: Variant) -> fx.GraphModule:
        for (_, axis), buckets in zip(self.groups, self.buckets):
            gm = all_reduce_gradients_pass(
                gm, buckets, group_name=axis.group_name, world_size=axis.size,
                accumulate=variant is Variant.SYNC_ACCUMULATED,
            )
        return gm

    def parameters(self) -> dict[int, Callable[[], torch.Tensor | None]]:
        """Each parameter's live tensor by forward-input index, for the backward's dispatch."""
        return {i.index: i.tensor for inputs, _ in self.groups for i in inputs if i.kind is InputKind.PARAMETER}
