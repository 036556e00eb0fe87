"""Context parallel's gradient reductions in buckets: one all-reduce per bucket of gradients, not per parameter.

Propagation reduces each parameter gradient (a partial sum over the cp group's chunks of the sequence) on its
own, where the marker wanted it whole: one all-reduce and one α per parameter. Here every all-reduce over the
group whose result the backward graph returns as it is comes out again, and the gradients are all-reduced in
DDP's size-capped buckets in readiness order (``buckets.plan_buckets``, ``all_reduce.all_reduce_gradients_pass``
summing): the same sums, fewer collectives. A data axis's own reduction (ddp's average, zero2's and fsdp's
reduce-scatters) then runs on the summed gradients as before.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dpar.compiler.graph_utils import refresh_fake_values
from dpar.compiler.passes.all_reduce import all_reduce_gradients_pass
from dpar.compiler.passes.buckets import Gradient, plan_buckets
from dpar.core.torch_internals import C10D_FUNCTIONAL

c10d = C10D_FUNCTIONAL


def bucket_returned_all_reduces(gm: fx.GraphModule, group_name: str, cap_bytes: int) -> fx.GraphModule:
    """The summing all-reduces over ``group_name`` of values ``gm`` returns, coalesced into buckets of
    ``cap_bytes`` (see the module docstring); ``gm`` unchanged where there is at most one."""
    graph = gm.graph
    output = graph.output_node()
    outputs = list(output.args[0])
    position = {n: i for i, n in enumerate(graph.nodes)}
    found: list[tuple[int, fx.Node, fx.Node]] = []  # (output index, all-reduce, wait)
    for index, node in enumerate(outputs):
        if not isinstance(node, fx.Node) or node.target is not c10d.wait_tensor.default or len(node.users) != 1:
            continue
        reduce = node.args[0]
        if (reduce.target is c10d.all_reduce.default and reduce.args[1:] == ("sum", group_name)
                and len(reduce.users) == 1 and outputs.count(node) == 1):
            found.append((index, reduce, node))
    if len(found) < 2:
        return gm
    gradients = []
    for index, reduce, wait in found:
        partial = reduce.args[0]
        val = reduce.meta["val"]  # the sum's shape and dtype (a pass before may have left its input without one)
        outputs[index] = partial
        gradients.append(Gradient(index, partial.name, tuple(val.shape), val.dtype, position[partial]))
    output.args = (tuple(outputs),)
    for _, reduce, wait in found:
        graph.erase_node(wait)
        graph.erase_node(reduce)
    placeholders = [n.meta["val"] for n in graph.nodes if n.op == "placeholder"]
    gm = all_reduce_gradients_pass(gm, plan_buckets(gradients, cap_bytes), group_name=group_name, world_size=1)
    refresh_fake_values(gm, placeholders)  # the passes after this one read the buckets' values
    return gm
