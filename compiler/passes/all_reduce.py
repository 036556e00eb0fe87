"""The DDP pass: one averaged all-reduce per gradient bucket, inside the backward graph."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from dpar.compiler.graph_utils import view_contiguous, with_code
from dpar.compiler.passes.buckets import BUCKET_REASON, Bucket
from dpar.core.torch_internals import C10D_FUNCTIONAL

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL


def accumulated_gradient_order(buckets: Sequence[Bucket]) -> list[int]:
    """Forward-input indices of the extra inputs ``accumulate=True`` adds, in order."""
    return [g.output_index for b in buckets for g in b.gradients]


def all_reduce_gradients_pass(
    gm: fx.GraphModule,
    buckets: Sequence[Bucket],
    *,
    group_name: str,
    world_size: int,
    accumulate: bool = False,
) -> fx.GraphModule:
    """Issue each bucket's all-reduce right after its last gradient is produced.

    Gradients are divided by the world size before the sum, as DDP's default
    hook does, so the result is the average over ranks. The wait comes right
    after the collective; ``sink_waits_pass`` moves it as late as it can go.

    With ``accumulate``, the graph takes one extra input per bucketed gradient
    (``accumulated_gradient_order``): the gradient accumulated locally under
    ``no_sync``, added before the reduction so that the total is averaged.
    """
    graph = gm.graph
    output = graph.output_node()
    outputs = list(output.args[0])
    accumulated = {}
    if accumulate:
        last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_before(last_placeholder.next):
            for index in accumulated_gradient_order(buckets):
                accumulated[index] = graph.placeholder(f"accumulated_grad_{index}")
    position = {n: i for i, n in enumerate(graph.nodes)}
    for bucket in buckets:
        grad_nodes = [outputs[g.output_index] for g in bucket.gradients]
        anchor = max(grad_nodes, key=lambda n: position[n])
        flats = []
        with graph.inserting_before(anchor.next):
            for grad, node in zip(bucket.gradients, grad_nodes):
                if accumulate:
                    node = graph.call_function(aten.add.Tensor, (node, accumulated[grad.output_index]))
                flats.append(view_contiguous(graph, node, [grad.numel]))
            flat = flats[0] if len(flats) == 1 else graph.call_function(aten.cat.default, (flats,))
            if world_size > 1:  # 1: a plain sum (context parallel's partial sums)
                flat = graph.call_function(aten.div.Tensor, (flat, world_size))
            reduced = graph.call_function(c10d.all_reduce.default, (flat, "sum", group_name))
            reduced.meta[BUCKET_REASON] = bucket.reason
            waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
            pieces = graph.call_function(
                aten.split_with_sizes.default, (waited, [g.numel for g in bucket.gradients])
            )
            for i, grad in enumerate(bucket.gradients):
                piece = graph.call_function(operator.getitem, (pieces, i))
                outputs[grad.output_index] = graph.call_function(
                    aten.view.default, (piece, list(grad.shape))
                )
    output.args = (tuple(outputs),)
    graph.lint()
    return with_code(gm)
