"""Turn a graph whose values carry placements into the program one rank runs on its local blocks.

Most ops need no change: an op that treats a dimension independently computes
its share from its inputs' shares. What changes is every explicit size (a
view to the global shape becomes a view to the local one), the vocabulary-split
embedding (look up only this rank's rows, zeros elsewhere, then the partial
sums add up to the full lookup), and its backward (scatter only into this
rank's rows); a cross-entropy over a vocabulary split the same way (``vocabulary_loss.py``). The tensor-parallel markers go: their block is the value itself; so do the experts' markers
(their value is this rank's share, placed by propagation) and context parallel's (its input arrives as
this rank's chunks of the sequence).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from dpar.compiler.propagation.propagate import GRAD_MARKER, WEIGHT_MARKER, MeshDim
from dpar.compiler.propagation.rules import EXPERTS_INPUT, EXPERTS_PARTIAL, LOG_SOFTMAX, NLL_LOSS
from dpar.compiler.propagation.vocabulary_loss import in_block, split_loss_op
from dpar.core.facts import local_block
from dpar.runtime.context_parallel import SEQUENCE_SPLIT

aten = torch.ops.aten

# Ops whose output shape is spelled out in their arguments (at this index).
_SIZED = {
    aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
    aten.slice_backward.default: 1, aten.select_backward.default: 1,
}


def _local_sizes(node: fx.Node, mesh: MeshDim) -> None:
    placement = node.meta.get("placement")
    if isinstance(placement, Shard):
        index = _SIZED[node.target]
        sizes = list(node.args[index])
        if sizes[placement.dim] != -1:
            sizes[placement.dim] = local_block(node.meta["val"].shape[placement.dim], mesh.size, mesh.rank)[1]
        node.args = (*node.args[:index], sizes, *node.args[index + 1:])


def _vocabulary_mask(graph: fx.Graph, indices: fx.Node, start: int, rows: int) -> tuple[fx.Node, fx.Node]:
    """(local row of each index, clamped to 0 where it is another rank's; mask of those)."""
    shifted, elsewhere = in_block(graph, indices, start, rows)
    return _zero_where(graph, elsewhere, shifted, 0), graph.call_function(aten.unsqueeze.default, (elsewhere, -1))


def _zero_where(graph: fx.Graph, mask: fx.Node, values: fx.Node, zero: int | float) -> fx.Node:
    """``values.masked_fill(mask, zero)`` as an op Inductor lowers directly: dpar's graphs reach it
    already decomposed, and masked_fill has only a decomposition there."""
    return graph.call_function(aten.where.ScalarSelf, (mask, zero, values))


def _split_embedding(graph: fx.Graph, node: fx.Node, mesh: MeshDim) -> None:
    weight, indices = node.args[:2]
    start, rows = local_block(weight.meta["val"].shape[0], mesh.size, mesh.rank)
    with graph.inserting_before(node):
        local, elsewhere = _vocabulary_mask(graph, indices, start, rows)
    node.args = (weight, local, *node.args[2:])
    with graph.inserting_after(node):
        masked = _zero_where(graph, elsewhere, node, 0.0)
    node.replace_all_uses_with(masked, delete_user_cb=lambda user: user is not masked)


def _split_embedding_backward(graph: fx.Graph, node: fx.Node, mesh: MeshDim) -> None:
    grad, indices, num_weights, padding_idx, *rest = node.args
    start, rows = local_block(num_weights, mesh.size, mesh.rank)
    local_padding = padding_idx - start
    with graph.inserting_before(node):
        local, elsewhere = _vocabulary_mask(graph, indices, start, rows)
        grad = _zero_where(graph, elsewhere, grad, 0.0)
    node.args = (grad, local, rows, local_padding if 0 <= local_padding < rows else -1, *rest)


def localize(gm: fx.GraphModule, mesh: MeshDim) -> fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):  # sizes first, while the markers still carry global shapes
        if node.op != "call_function":
            continue
        if node.target in _SIZED:
            _local_sizes(node, mesh)
        elif node.target is aten.embedding.default and node.meta.get("placement_inputs", (None,))[0] == Shard(0):
            _split_embedding(graph, node, mesh)
        elif node.target is aten.embedding_dense_backward.default and node.meta.get("placement") == Shard(0):
            _split_embedding_backward(graph, node, mesh)
        elif node.target in LOG_SOFTMAX | NLL_LOSS and not mesh.period:
            split_loss_op(graph, node, mesh)
    # This axis's markers only: under cp and tp the context axis's stay for its own propagation, after tp's.
    markers = (SEQUENCE_SPLIT,) if mesh.period else (WEIGHT_MARKER, GRAD_MARKER, EXPERTS_PARTIAL, EXPERTS_INPUT)
    for node in list(graph.nodes):
        if node.target in markers:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.lint()
    return gm
