"""ddp over the ``dp`` axis of a ``("dp", "pp")`` mesh: the all-reduce goes into a stage's last backward graph.

[Note: data parallel across pipelines]
Each pipeline (one per ``dp`` index) accumulates its stages' parameter gradients over the
micro-batches. The gradients must then be averaged over ``dp``, once per step, as DDP does. dpar
builds a *sync* variant of the graph that runs a stage's last backward work of the step (its last
``B``, or its last ``W`` under a zero-bubble schedule): the variant takes the gradients accumulated
over the earlier micro-batches as extra inputs, adds its own, and all-reduces the totals in
buckets, each issued as soon as its last gradient is computed. It is ddp's own pass
(``all_reduce_gradients_pass`` with ``accumulate=True``, the variant ``no_sync`` accumulation
uses) followed by ``sink_waits``, so the bucketing, the averaging and the overlap inside the graph
are the ones ddp's tests pin. ``PipelinePassListing`` in ``pass_listing.py`` runs them, in that order.
"""

from __future__ import annotations


import torch.fx as fx

from dpar.compiler.graph_utils import fake_like, refresh_fake_values
from dpar.compiler.passes.all_reduce import accumulated_gradient_order, all_reduce_gradients_pass
from dpar.compiler.passes.buckets import Gradient, plan_buckets
from dpar.core.pipeline_program import StageGraphs, SyncVariant


def _gradients(gm: fx.GraphModule, graphs: StageGraphs, first: int) -> list[Gradient]:
    outputs = gm.graph.output_node().args[0]
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    gradients = []
    for k, name in enumerate(graphs.parameter_names):
        node = outputs[first + k]
        if isinstance(node, fx.Node):
            value = node.meta["val"]
            gradients.append(Gradient(first + k, name, tuple(value.shape), value.dtype, position[node]))
    return gradients


class StageGradientBuckets:
    """The parameter gradients of the graph that ends a stage's step, in buckets, planned on a copy of that graph
    (``which``: ``"backward"`` or ``"backward_weight"``) before ``all_reduce`` rewrites it."""

    def __init__(self, gm: fx.GraphModule, graphs: StageGraphs, which: str, *, group_name: str, dp_size: int,
                 cap_bytes: int) -> None:
        self.first = len(graphs.grad_inputs) if which == "backward" else 0  # B returns input gradients first
        gradients = _gradients(gm, graphs, self.first)
        outputs = gm.graph.output_node().args[0]
        self.like = {g.output_index: outputs[g.output_index].meta["val"] for g in gradients}  # before the rewiring
        self.buckets = plan_buckets(gradients, cap_bytes)
        self.group_name, self.dp_size = group_name, dp_size

    def all_reduce(self, gm: fx.GraphModule) -> fx.GraphModule:
        """ddp's pass, accumulating: the earlier micro-batches' gradients come in as inputs."""
        return all_reduce_gradients_pass(
            gm, self.buckets, group_name=self.group_name, world_size=self.dp_size, accumulate=True)

    def variant(self, gm: fx.GraphModule) -> SyncVariant:
        """The rewritten graph, its accumulated-gradient inputs shaped as the gradients."""
        order = accumulated_gradient_order(self.buckets)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, index in zip(placeholders[len(placeholders) - len(order):], order):
            node.meta["val"] = fake_like(self.like[index])  # the accumulated gradient: shaped as the gradient
        refresh_fake_values(gm, [n.meta["val"] for n in placeholders])  # the tables and Inductor read them
        return SyncVariant(gm, tuple(index - self.first for index in order))
