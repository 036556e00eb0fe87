"""The cross-entropy of logits split by vocabulary, computed where they are: each rank its block of the classes.

[Note: a loss over a split vocabulary]
A column-parallel LM head hands each rank its block of the vocabulary. Gathering the logits to take the
cross-entropy costs a rows x vocabulary all-gather and, worse, a whole log-softmax on every rank, saved for the
backward (Llama-3's 128,256 classes over 2,048 tokens are 1.05 GB a sequence, per rank, whatever the tp degree).
Megatron's vocabulary-parallel cross-entropy keeps them split, and so does this rewrite of the ops the loss
decomposes into (the planner prices the loss so: ``planner/rules.py``):

- ``_log_softmax(x)``: the row maximum and the sum of exponentials are all-reduced over the group (max, then sum),
  then ``x - max - log(sum)`` on this rank's block: the single device's formula, its sum taken in another order.
- ``nll_loss_forward``: each rank picks the targets that fall in its block (the rest, and ignored targets, are
  ignored on it), summed: a partial sum of the loss; a mean divides by the count of the whole batch's targets
  that are not ignored, which every rank counts from the targets it holds whole.
- their backwards: ``_log_softmax_backward_data`` all-reduces the row sum of the incoming gradient;
  ``nll_loss_backward`` scatters into this rank's block only, with the whole batch's count.

Only an unweighted loss over (rows, classes) is split (``rules.nll_loss``); anything else reads the log-probabilities
whole, as before.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from dpar.compiler.propagation.propagate import MeshDim
from dpar.compiler.propagation.redistribute import activation_collective
from dpar.core.facts import local_block
from dpar.core.torch_internals import C10D_FUNCTIONAL

aten, prims = torch.ops.aten, torch.ops.prims  # casts as prims: Inductor lowers them (aten._to_copy it decomposes)
c10d = C10D_FUNCTIONAL

LOCAL_IGNORE = -1
"""The ignore index of a rank's own call: never a local class, so every target outside the block is skipped."""


def split_loss_op(graph: fx.Graph, node: fx.Node, mesh: MeshDim) -> None:
    """Rewrite ``node`` to this rank's block of the classes where propagation split it by class (no-op otherwise)."""
    if node.target is aten._log_softmax.default and _split_along(node, node.args[1], node.meta.get("placement")):
        _log_softmax(graph, node, mesh)
    elif node.target is aten._log_softmax_backward_data.default and _split_along(node, node.args[2], node.meta.get("placement")):
        _log_softmax_backward(graph, node, mesh)
    elif node.target is aten.nll_loss_forward.default and node.meta.get("placement_inputs", (None,))[0] == Shard(1):
        _nll_loss(graph, node, mesh)
    elif node.target is aten.nll_loss_backward.default and node.meta.get("placement") == Shard(1):
        _nll_loss_backward(graph, node, mesh)


def _split_along(node: fx.Node, dim: int, placement: object) -> bool:
    return placement == Shard(dim % node.meta["val"].dim())


def _all_reduce(graph: fx.Graph, value: fx.Node, op: str, mesh: MeshDim) -> fx.Node:
    reduced = activation_collective(graph, c10d.all_reduce.default, (value, op, mesh.group_name))
    return graph.call_function(c10d.wait_tensor.default, (reduced,))


def _log_softmax(graph: fx.Graph, node: fx.Node, mesh: MeshDim) -> None:
    x, dim, half_to_float = node.args
    with graph.inserting_before(node):
        if half_to_float:
            x = graph.call_function(prims.convert_element_type.default, (x, torch.float32))
        peak = _all_reduce(graph, graph.call_function(aten.amax.default, (x, [dim], True)), "max", mesh)
        shifted = graph.call_function(aten.sub.Tensor, (x, peak))
        exponentials = graph.call_function(aten.exp.default, (shifted,))
        total = _all_reduce(graph, graph.call_function(aten.sum.dim_IntList, (exponentials, [dim], True)), "sum", mesh)
        result = graph.call_function(aten.sub.Tensor, (shifted, graph.call_function(aten.log.default, (total,))))
    _replace(graph, node, result)


def _log_softmax_backward(graph: fx.Graph, node: fx.Node, mesh: MeshDim) -> None:
    grad, output, dim, input_dtype = node.args
    with graph.inserting_before(node):
        total = _all_reduce(graph, graph.call_function(aten.sum.dim_IntList, (grad, [dim], True)), "sum", mesh)
        spread = graph.call_function(aten.mul.Tensor, (graph.call_function(aten.exp.default, (output,)), total))
        result = graph.call_function(aten.sub.Tensor, (grad, spread))
        if input_dtype != node.meta["val"].dtype or input_dtype != grad.meta["val"].dtype:
            result = graph.call_function(prims.convert_element_type.default, (result, input_dtype))
    _replace(graph, node, result)


def _replace(graph: fx.Graph, node: fx.Node, result: fx.Node) -> None:
    """``node``'s uses read ``result``, which keeps its (global) value and placement until the values are refreshed."""
    result.meta.update(val=node.meta["val"], placement=node.meta["placement"])
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def in_block(graph: fx.Graph, indices: fx.Node, start: int, rows: int) -> tuple[fx.Node, fx.Node]:
    """(each index less ``start``: its row in a block of ``rows`` from ``start``; where it falls outside the block)."""
    shifted = graph.call_function(aten.sub.Tensor, (indices, start))
    outside = graph.call_function(aten.logical_or.default, (
        graph.call_function(aten.lt.Scalar, (shifted, 0)), graph.call_function(aten.ge.Scalar, (shifted, rows))))
    return shifted, outside


def _own_targets(graph: fx.Graph, target: fx.Node, ignore_index: int, classes: int, mesh: MeshDim) -> fx.Node:
    """Each target as a class of this rank's block, ``LOCAL_IGNORE`` where it is another rank's or ignored."""
    shifted, outside = in_block(graph, target, *local_block(classes, mesh.size, mesh.rank))
    skipped = graph.call_function(aten.logical_or.default, (outside, graph.call_function(aten.eq.Scalar, (target, ignore_index))))
    return graph.call_function(aten.where.ScalarSelf, (skipped, LOCAL_IGNORE, shifted))


def _nll_loss(graph: fx.Graph, node: fx.Node, mesh: MeshDim) -> None:
    scores, target, weight, reduction, ignore_index = node.args
    mean = reduction == 1
    with graph.inserting_before(node):
        own = _own_targets(graph, target, ignore_index, scores.meta["val"].shape[1], mesh)
        valid = graph.call_function(aten.ne.Scalar, (target, ignore_index))
        count = graph.call_function(aten.sum.default, (valid,), {"dtype": node.meta["val"][1].dtype})
    node.args = (scores, own, weight, 2 if mean else reduction, LOCAL_IGNORE)  # 2: sum, divided below
    for user in list(node.users):
        if user.args[1] == 1:  # the count of targets: the whole batch's
            user.replace_all_uses_with(count)
            graph.erase_node(user)
        elif mean:
            with graph.inserting_after(user):
                averaged = graph.call_function(aten.div.Tensor, (user, count))
            user.replace_all_uses_with(averaged, delete_user_cb=lambda u: u is not averaged)


def _nll_loss_backward(graph: fx.Graph, node: fx.Node, mesh: MeshDim) -> None:
    grad, scores, target, weight, reduction, ignore_index, count = node.args
    with graph.inserting_before(node):
        own = _own_targets(graph, target, ignore_index, scores.meta["val"].shape[1], mesh)
    node.args = (grad, scores, own, weight, reduction, LOCAL_IGNORE, count)
