"""Turn a graph whose values carry placements into the program one rank runs on its local blocks.

Most ops need no change: an op that treats a dimension independently computes
its share from its inputs' shares. What changes is every explicit size (a
view to the global shape becomes a view to the local one), the vocabulary-split
embedding (look up only this rank's rows, zeros elsewhere, then the partial
sums add up to the full lookup), and its backward (scatter only into this
rank's rows). The tensor-parallel markers go: their block is the value itself.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from dpar.compiler.propagation.propagate import GRAD_MARKER, WEIGHT_MARKER, MeshDim

aten = torch.ops.aten

_SIZED = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default}


def _local_sizes(node: fx.Node, size: int) -> None:
    placement = node.meta.get("placement")
    if isinstance(placement, Shard):
        sizes = list(node.args[1])
        if sizes[placement.dim] != -1:
            sizes[placement.dim] //= size
        node.args = (node.args[0], sizes, *node.args[2:])


def _vocabulary_mask(graph: fx.Graph, indices: fx.Node, rows: int, rank: int) -> tuple[fx.Node, fx.Node]:
    """(local row of each index, clamped to 0 where it is another rank's; mask of those)."""
    shifted = graph.call_function(aten.sub.Tensor, (indices, rank * rows))
    below = graph.call_function(aten.lt.Scalar, (shifted, 0))
    above = graph.call_function(aten.ge.Scalar, (shifted, rows))
    elsewhere = graph.call_function(aten.logical_or.default, (below, above))
    local = graph.call_function(aten.masked_fill.Scalar, (shifted, elsewhere, 0))
    return local, graph.call_function(aten.unsqueeze.default, (elsewhere, -1))


def _split_embedding(graph: fx.Graph, node: fx.Node, mesh: MeshDim) -> None:
    weight, indices = node.args[:2]
    rows = weight.meta["val"].shape[0] // mesh.size
    with graph.inserting_before(node):
        local, elsewhere = _vocabulary_mask(graph, indices, rows, mesh.rank)
    node.args = (weight, local, *node.args[2:])
    with graph.inserting_after(node):
        masked = graph.call_function(aten.masked_fill.Scalar, (node, elsewhere, 0.0))
    node.replace_all_uses_with(masked, delete_user_cb=lambda user: user is not masked)


def _split_embedding_backward(graph: fx.Graph, node: fx.Node, mesh: MeshDim) -> None:
    grad, indices, num_weights, padding_idx, *rest = node.args
    rows = num_weights // mesh.size
    local_padding = padding_idx - mesh.rank * rows
    with graph.inserting_before(node):
        local, elsewhere = _vocabulary_mask(graph, indices, rows, mesh.rank)
        grad = graph.call_function(aten.masked_fill.Scalar, (grad, elsewhere, 0.0))
    node.args = (grad, local, rows, local_padding if 0 <= local_padding < rows else -1, *rest)


def localize(gm: fx.GraphModule, mesh: MeshDim) -> fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):  # sizes first, while the markers still carry global shapes
        if node.op != "call_function":
            continue
        if node.target in _SIZED:
            _local_sizes(node, mesh.size)
        elif node.target is aten.embedding.default and node.meta.get("placement_inputs", (None,))[0] == Shard(0):
            _split_embedding(graph, node, mesh)
        elif node.target is aten.embedding_dense_backward.default and node.meta.get("placement") == Shard(0):
            _split_embedding_backward(graph, node, mesh)
    for node in list(graph.nodes):
        if node.target in (WEIGHT_MARKER, GRAD_MARKER):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.lint()
    return gm
