"""The tensor-parallel pass: from the joint graph of the single-device program to one rank's share of it.

Runs on the joint forward+backward graph, before the partitioner, so that one
propagation sees the forward and the backward together and the partitioner
saves what the local program needs. See [Note: how a tensor-parallel parameter
reaches the graph] in ``runtime/tensor_parallel.py``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dpar.compiler.graph_utils import refresh_fake_values, with_code
from dpar.compiler.propagation.localize import localize
from dpar.compiler.passes.sequence_parallel import tag_sequence_gathers_for_recompute
from dpar.compiler.propagation.propagate import LOW_PRECISION, MeshDim, propagate_placements

aten = torch.ops.aten


def split_addmm(gm: fx.GraphModule) -> fx.GraphModule:
    """``addmm(bias, a, b)`` -> ``mm(a, b) + bias``: a row-parallel product is a partial sum,
    which must be reduced before the bias is added once (Inductor fuses the add back).

    Where the product is only viewed back to the token layout (a Linear on
    ``(batch, seq, hidden)``), the bias is added after the view, so that sequence
    parallel can reduce-scatter the sum along the sequence there.

    A low-precision ``addmm`` (bf16 under autocast) adds the bias to its fp32 accumulator and
    rounds once; ``mm`` then ``add`` in bf16 would round twice. So the product and the sum are
    computed in fp32 and rounded after the bias, as ``addmm`` does: see [Note: partial sums in
    low precision] in ``propagation/redistribute.py``.
    """
    graph = gm.graph
    views = (aten.view.default, aten._unsafe_view.default)
    for node in list(graph.nodes):
        if node.target is not aten.addmm.default or node.kwargs:
            continue
        bias, a, b = node.args
        users = list(node.users)
        viewed = users[0] if len(users) == 1 and users[0].target in views else None
        if viewed is not None and viewed.meta["val"].shape[-1] != node.meta["val"].shape[-1]:
            viewed = None
        dtype = node.meta["val"].dtype
        wide = dtype in LOW_PRECISION
        with graph.inserting_before(node):
            if wide:
                a, b, bias = (_cast(graph, v, torch.float32) for v in (a, b, bias))
            product = graph.call_function(aten.mm.default, (a, b))
            product.meta["val"] = _as(node.meta["val"], a.meta["val"].dtype)
            if viewed is not None:
                product = graph.call_function(viewed.target, (product, *viewed.args[1:]))
                product.meta["val"] = _as(viewed.meta["val"], a.meta["val"].dtype)
            total = graph.call_function(aten.add.Tensor, (product, bias))
            total.meta["val"] = product.meta["val"]
            if wide:
                total = _cast(graph, total, dtype)
        if viewed is not None:
            viewed.replace_all_uses_with(total)
            graph.erase_node(viewed)
        node.replace_all_uses_with(total)
        graph.erase_node(node)
    return gm


def _as(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return val if val.dtype == dtype else val.to(dtype)


def _cast(graph: fx.Graph, value: fx.Node, dtype: torch.dtype) -> fx.Node:
    node = graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
    node.meta["val"] = _as(value.meta["val"], dtype)
    return node


def tensor_parallel_pass(gm: fx.GraphModule, mesh: MeshDim) -> fx.GraphModule:
    """Propagate placements from the markers, insert the collectives, rewrite to local shapes."""
    gm = localize(propagate_placements(split_addmm(gm), mesh), mesh)
    refresh_fake_values(gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])
    if mesh.sequence_parallel:
        tag_sequence_gathers_for_recompute(gm, mesh.group_name)
    return with_code(gm)
