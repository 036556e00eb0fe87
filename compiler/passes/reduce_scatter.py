"""Sharded gradients: one averaged, flattened reduce-scatter per bucket."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from dpar.compiler.collectives import WAIT
from dpar.compiler.graph_utils import restore_topological_order, view_contiguous, with_code
from dpar.compiler.passes.all_gather import ParameterGroup
from dpar.compiler.propagation.redistribute import ACTIVATION_COLLECTIVE
from dpar.core.torch_internals import C10D_FUNCTIONAL

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL


def _output_positions(node: fx.Node, output: fx.Node) -> set[int]:
    """Which graph outputs ``node`` flows into."""
    outputs = output.args[0]
    reached, seen, frontier = set(), {node}, [node]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user is output:
                reached |= {i for i, o in enumerate(outputs) if o is current}
            elif user not in seen:
                seen.add(user)
                frontier.append(user)
    return reached


def bucket_reduce_scatters_pass(
    gm: fx.GraphModule,
    groups: Sequence[ParameterGroup],
    *,
    group_name: str,
    world_size: int,
    reduce_dtype: torch.dtype | None = None,
    replicate: tuple[str, int] | None = None,
) -> fx.GraphModule:
    """Replace each group's per-parameter reduce-scatters by one over their concatenation.

    Each full gradient is viewed as [world, shard size]; concatenating those
    column-wise puts every rank's shards of the whole bucket in one row, so one
    reduce-scatter hands rank r all of its shards. Gradients are divided by the
    world size first, so shards hold the average over ranks, as with DDP.

    With ``reduce_dtype`` the bucket is cast before the reduction; a cast of the
    result back to ``reduce_dtype`` that the graph already does (mixed precision
    computes in bf16 and stores float32 gradients) reads the reduced value directly.

    With ``replicate`` (hsdp: group name and size), the all-reduce that DTensor
    places on each full gradient before its reduce-scatter is dropped, and each
    bucket's reduced shards are all-reduced (averaged) across replicas instead:
    1/N of the bytes.
    """
    graph = gm.graph
    if replicate is not None:
        _drop_full_gradient_all_reduces(graph)
    output = graph.output_node()
    scatters: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:  # gradients only: tensor parallel also reduce-scatters activations
        if node.target is c10d.reduce_scatter_tensor.default and not node.meta.get(ACTIVATION_COLLECTIVE):
            for position in _output_positions(node, output):
                scatters.setdefault(position, []).append(node)
    for position, tied in scatters.items():
        if len(tied) > 1:
            scatters[position] = [_sum_before_reducing(graph, tied)]
    for group in groups:
        members = [rs for i in group.gradients for rs in scatters.get(i, [])]
        by_dtype: dict[torch.dtype, list[fx.Node]] = {}
        for rs in dict.fromkeys(members):
            by_dtype.setdefault(rs.args[0].meta["val"].dtype, []).append(rs)
        for nodes in by_dtype.values():
            _bucket(graph, nodes, group_name, world_size, reduce_dtype, replicate)
    restore_topological_order(graph)  # consumers of a reduced shard (unpadding) follow the bucket
    graph.eliminate_dead_code()
    graph.lint()
    return with_code(gm)


def _sum_before_reducing(graph: fx.Graph, tied: list[fx.Node]) -> fx.Node:
    """A parameter read twice (tied weights, or the copies of a tensor-parallel group's rows) gets several
    gradients: add them, reduce-scatter once.

    The other reduce-scatters' results are zeros, so the graph's own sum of the shards stays right; their
    collectives are gone, and so are the sums of those zeros (``_without_zero_terms``).
    """
    kept, *others = tied
    total = kept.args[0]
    zeros = []
    with graph.inserting_before(kept):
        for other in others:
            total = graph.call_function(aten.add.Tensor, (total, other.args[0]))
            total.meta["val"] = kept.args[0].meta["val"]  # the bucketing reads shapes from it
            val = other.meta["val"]
            for wait in [u for u in other.users if u.target is WAIT]:
                zeros.append(graph.call_function(  # full, not zeros: Inductor lowers it without a decomposition
                    aten.full.default, (list(val.shape), 0), {"dtype": val.dtype, "device": val.device}
                ))
                zeros[-1].meta["val"] = val
                wait.replace_all_uses_with(zeros[-1])
                graph.erase_node(wait)
            graph.erase_node(other)
    kept.args = (total, *kept.args[1:])
    _without_zero_terms(graph, zeros)
    return kept


def _without_zero_terms(graph: fx.Graph, zeros: list[fx.Node]) -> None:
    """Each ``x + 0`` of the same shape and dtype read as ``x``.

    Left in, the sum of the copies' shards started right after the kept reduce-scatter's wait and
    read zeros made elsewhere, which pinned the wait there: no gradient reduction overlapped the
    rest of the backward.
    """
    pending = list(zeros)
    while pending:
        zero = pending.pop()
        for user in list(zero.users):
            if user.target is not aten.add.Tensor or user.kwargs or len(user.args) != 2:
                continue
            other = user.args[1] if user.args[0] is zero else user.args[0]
            val, out = getattr(other, "meta", {}).get("val"), user.meta.get("val")
            if not isinstance(val, torch.Tensor) or out is None or (val.shape, val.dtype) != (out.shape, out.dtype):
                continue
            user.replace_all_uses_with(other)
            graph.erase_node(user)
            if other in zeros:
                pending.append(other)


def _is_cast_to(node: fx.Node, dtype: torch.dtype) -> bool:
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1] == dtype
    return node.target is aten._to_copy.default and node.kwargs.get("dtype") == dtype and len(node.kwargs) == 1


# What DTensor puts between a gradient and its reduce-scatter: padding of uneven shards.
_RESHAPING = {
    aten.constant_pad_nd.default,
    aten.split.Tensor,
    aten.cat.default,
    aten.view.default,
    aten.slice.Tensor,
    aten.clone.default,
    operator.getitem,
}


def _drop_full_gradient_all_reduces(graph: fx.Graph) -> None:
    """Remove each all-reduce whose result only feeds a reduce-scatter (through padding).

    Matched by position, not group name: DTensor caches redistribution plans per
    equal mesh, so a second mesh of the same shape may trace the first one's groups.
    """
    for rs in [n for n in graph.nodes if n.target is c10d.reduce_scatter_tensor.default]:
        frontier, seen = [rs.args[0]], set()
        while frontier:
            node = frontier.pop()
            if node in seen:
                continue
            seen.add(node)
            if node.target is WAIT:
                reduce = node.args[0]
                if reduce.target is c10d.all_reduce.default:
                    node.replace_all_uses_with(reduce.args[0])
                    graph.erase_node(node)
                    graph.erase_node(reduce)
            elif node.target in _RESHAPING:
                frontier.extend(node.all_input_nodes)


def _bucket(
    graph: fx.Graph,
    scatters: list[fx.Node],
    group_name: str,
    world_size: int,
    reduce_dtype: torch.dtype | None,
    replicate: tuple[str, int] | None,
) -> None:
    position = {n: i for i, n in enumerate(graph.nodes)}
    grads = [rs.args[0] for rs in scatters]
    sizes = [int(g.meta["val"].numel()) // world_size for g in grads]
    last = max(grads, key=position.__getitem__)
    with graph.inserting_before(last.next):
        rows = []
        for grad, size in zip(grads, sizes):
            rows.append(view_contiguous(graph, grad, [world_size, size]))
        matrix = rows[0] if len(rows) == 1 else graph.call_function(aten.cat.default, (rows, 1))
        flat = graph.call_function(aten.view.default, (matrix, [world_size * sum(sizes)]))
        computed = grads[0].meta["val"].dtype
        if reduce_dtype is not None and reduce_dtype != computed:
            flat = graph.call_function(torch.ops.prims.convert_element_type.default, (flat, reduce_dtype))
        flat = graph.call_function(aten.div.Tensor, (flat, world_size))
        reduced = graph.call_function(c10d.reduce_scatter_tensor.default, (flat, "sum", world_size, group_name))
        waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
        if replicate is not None:
            replica_group, replicas = replicate
            averaged = graph.call_function(aten.div.Tensor, (waited, replicas))
            across = graph.call_function(c10d.all_reduce.default, (averaged, "sum", replica_group))
            waited = graph.call_function(c10d.wait_tensor.default, (across,))
        pieces = graph.call_function(aten.split_with_sizes.default, (waited, sizes))
        for i, rs in enumerate(scatters):
            piece = graph.call_function(operator.getitem, (pieces, i))
            shard = graph.call_function(aten.view.default, (piece, list(rs.meta["val"].shape)))
            reduced_in = reduce_dtype if reduce_dtype is not None else computed
            as_computed = shard
            if reduced_in != computed:
                as_computed = graph.call_function(torch.ops.prims.convert_element_type.default, (shard, computed))
            for old_wait in [u for u in rs.users if u.target is WAIT]:
                for cast in [u for u in old_wait.users if _is_cast_to(u, reduced_in)]:
                    cast.replace_all_uses_with(shard)
                    graph.erase_node(cast)
                old_wait.replace_all_uses_with(as_computed)
                graph.erase_node(old_wait)
    for rs in scatters:
        graph.erase_node(rs)  # collectives are side-effectful: dead-code elimination keeps them
