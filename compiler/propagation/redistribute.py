"""Moving a value from one placement to another: what it costs and the graph nodes that do it.

All-reduce for partial → replicate, reduce-scatter for partial → shard,
all-gather for shard → replicate, all-to-all for shard → shard along another
dimension, a local slice for replicate → shard (free).
Costs are α-β with ring collectives: all-reduce moves 2(N-1)/N of the bytes,
all-gather and reduce-scatter (N-1)/N, plus a fixed latency per collective so
that, bytes being equal, fewer collectives win.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from dpar.compiler.graph_utils import call
from dpar.core.facts import local_block
from dpar.core.torch_internals import C10D_FUNCTIONAL

# [Note: partial sums in low precision]
# One device computes a bf16 product (autocast's mm, addmm, bmm) by accumulating in fp32 and
# rounding once, after the bias where there is one. Split over tp ranks, the same contraction
# is a partial sum per rank: rounded to bf16 on each rank, reduced in bf16 and the bias added
# in bf16 (Megatron's way, and DTensor's), each value is rounded two or three times, and the
# differences, a bf16 ulp here and there, grow over training (nanoGPT under CPU bf16 autocast,
# 5 AdamW steps at lr 1e-2: 7.1e-2 from torch DDP, where dpar's ddp gives 0). So tensor
# parallel rounds where the single-device program does:
# - ``split_addmm`` computes a low-precision addmm as an fp32 product plus the bias, rounded
#   once after the bias (the product is reduced before the bias where it is a partial sum);
# - propagation computes any other low-precision mm/bmm that becomes a partial sum in fp32
#   (``_accumulate_in_fp32``), rounded by a cast right after it;
# - reducing a partial sum reached through such casts (and views and transposes between
#   them: a backward's ``_to_copy`` to fp32 after a bf16 product) reduces the sum before the
#   first cast and replays the casts and views on the whole sum (``_before_rounding``).
# The result is the single-device rounding: dpar's tp then gives the same bits as DDP on that
# model (0.0 after 5 steps). The cost is the reduction's bytes: an fp32 partial sum moves
# twice a bf16 one's (row-parallel outputs; the backward's were fp32 already), and the
# products that are partial sums run on fp32 inputs (on CPU, the same bf16 products
# accumulated the same way).

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL

ACTIVATION_COLLECTIVE = "dpar_activation_collective"
"""``node.meta`` key on the collectives this module inserts: data parallel's passes leave them alone."""

LATENCY_BYTES = 64 * 1024
"""One collective's latency, in bytes a link moves in that time (α/β)."""

SLICE_COST = 1.0
"""A local slice moves nothing; this tie-breaker prefers no op at all."""


def cost(src: Placement, dst: Placement, nbytes: int, tp: int) -> float:
    """Bytes-equivalent cost of redistributing a value of ``nbytes`` (its full size) over ``tp`` ranks."""
    if src == dst:
        return 0.0
    share = (tp - 1) / tp * nbytes
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return 2 * share + LATENCY_BYTES
        return share + LATENCY_BYTES  # reduce-scatter
    if isinstance(src, Replicate):
        return SLICE_COST if isinstance(dst, Shard) else math.inf  # replicate -> partial: never needed
    if isinstance(dst, Replicate):
        return share + LATENCY_BYTES  # all-gather
    if isinstance(dst, Shard):
        return share / tp + LATENCY_BYTES  # all-to-all: each rank sends (N-1)/N of its block
    return math.inf  # shard -> partial


def nbytes_of(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


def _call(graph: fx.Graph, target: object, args: tuple[object, ...], placement: Placement) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["placement"] = placement
    return node


def _dim_first(graph: fx.Graph, value: fx.Node, dim: int, ndim: int) -> tuple[fx.Node, list[int]]:
    """``value`` with ``dim`` moved to the front, contiguous (collectives work on dim 0 of a dense tensor): a
    copy, unless the move leaves the memory as it is (``_in_place``)."""
    order = [dim] + [d for d in range(ndim) if d != dim]
    in_place = _in_place(value.meta["val"], order)
    if dim != 0:
        value = graph.call_function(aten.permute.default, (value, order))
    if in_place:
        return value, order
    dense = graph.call_function(aten.clone.default, (value,), {"memory_format": torch.contiguous_format})
    return dense, order


def _in_place(val: torch.Tensor, order: list[int]) -> bool:
    """Whether ``val`` is contiguous and stays so permuted by ``order``: the permutation moves only dimensions of
    size 1 past the others (a one-row batch's (1, T, C) token stream split along T), so no copy is needed."""
    shape = val.shape
    return val.is_contiguous() and [d for d in order if shape[d] != 1] == [d for d in range(len(shape)) if shape[d] != 1]


def _dim_back(graph: fx.Graph, value: fx.Node, order: list[int], val: torch.Tensor) -> fx.Node:
    """Undo ``_dim_first`` of the value traced as ``val``, dense again, with the dimensions in memory in its own
    order (``memory_layout``): consumers were traced with the value's own strides (a view after a transpose needs
    them). No copy where ``_dim_first`` needed none."""
    layout = memory_layout(val)
    if order == sorted(order) and layout is None:
        return value
    back = graph.call_function(aten.permute.default, (value, _inverse(order)))
    return back if _in_place(val, order) else dense_in(graph, back, layout)


def dense_in(graph: fx.Graph, value: fx.Node, layout: list[int] | None) -> fx.Node:
    """A dense copy of ``value`` laid out in memory in ``layout``'s order (``None``: contiguous)."""
    if layout is None:
        return graph.call_function(aten.clone.default, (value,), {"memory_format": torch.contiguous_format})
    physical = graph.call_function(aten.permute.default, (value, layout))
    dense = graph.call_function(aten.clone.default, (physical,), {"memory_format": torch.contiguous_format})
    return graph.call_function(aten.permute.default, (dense, _inverse(layout)))


def _inverse(order: list[int]) -> list[int]:
    return [order.index(d) for d in range(len(order))]


def memory_layout(val: torch.Tensor) -> list[int] | None:
    """The dimensions of a dense, non-contiguous value from outermost to innermost in memory (a transposed
    activation's); ``None`` for a contiguous value or one that is not dense (an expanded one), which the
    collectives' contiguous outputs stand in for as they did at trace time."""
    if val.is_contiguous():
        return None
    order = sorted(range(val.ndim), key=lambda d: -val.stride(d))
    expected = 1
    for d in reversed(order):
        if val.shape[d] != 1 and val.stride(d) != expected:
            return None
        expected *= val.shape[d]
    return order


def redistribute(
    graph: fx.Graph, value: fx.Node, src: Placement, dst: Placement, *, tp: int, rank: int, group_name: str,
    period: int = 0,
) -> fx.Node:
    """Nodes (at the graph's insertion point) turning ``value`` from ``src`` into ``dst``.

    ``period`` > 0: a shard is the balanced layout of a context-parallel axis (see [Note: a sequence's two
    chunks per rank]) instead of contiguous blocks. The result carries ``value``'s global fake value, as
    propagation reads global shapes.
    """
    replay: list[fx.Node] = []
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        value, replay = _before_rounding(value)
    if period and (isinstance(src, Shard) or isinstance(dst, Shard)):
        result = _balanced(graph, value, src, dst, BalancedLayout(tp, rank, period), group_name)
    else:
        result = _redistribute(graph, value, src, dst, tp=tp, rank=rank, group_name=group_name)
    result.meta["val"] = value.meta["val"]
    for step in replay:  # what the single-device program does to the whole sum, after it
        result = _call(graph, step.target, (result, *step.args[1:]), dst)
        result.kwargs = dict(step.kwargs)
        result.meta["val"] = step.meta["val"]
    return result


_REARRANGES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
               aten.transpose.int, aten.permute.default, aten.clone.default, aten.alias.default}


def _before_rounding(value: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """For a partial sum that was cast to another dtype on the way (through views and transposes):
    the partial sum before the first cast, and the ops from there to ``value`` (first applied first);
    else ``value`` and nothing. See [Note: partial sums in low precision]."""
    chain, source = [], value
    while (
        (source.target in _REARRANGES or source.target is aten._to_copy.default)
        and isinstance(source.args[0], fx.Node)
        and isinstance(source.args[0].meta.get("placement"), Partial)
    ):
        chain.append(source)
        source = source.args[0]
    casts = [i for i, n in enumerate(chain) if n.target is aten._to_copy.default]
    if not casts:
        return value, []
    first = casts[-1]  # chain runs from value back to the source
    return chain[first].args[0], chain[: first + 1][::-1]


def activation_collective(graph: fx.Graph, target: object, args: tuple[object, ...]) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta[ACTIVATION_COLLECTIVE] = True
    return node


def _all_to_all(graph: fx.Graph, value: fx.Node, src: int, dst: int, tp: int, group_name: str) -> fx.Node:
    """This rank's block along ``src`` -> its block along ``dst``: one all-to-all.

    With ``dst`` moved to the front, chunk j of the rows goes to rank j; what
    comes back is, per source rank, that rank's ``src`` block of this rank's
    rows, so the ranks' axis is merged into ``src`` in rank order.
    """
    local = list(value.meta["val"].shape)  # global; this rank holds 1/tp of src
    local[src] //= tp
    dense, order = _dim_first(graph, value, dst, len(local))
    rows = local[dst] // tp
    exchanged = activation_collective(graph, c10d.all_to_all_single.default, (dense, [rows] * tp, [rows] * tp, group_name))
    waited = graph.call_function(c10d.wait_tensor.default, (exchanged,))
    dims = [local[d] for d in order]
    by_rank = graph.call_function(aten.view.default, (waited, [tp, rows, *dims[1:]]))
    at = order.index(src) + 1  # src's axis in by_rank
    beside = graph.call_function(aten.permute.default, (by_rank, [1, *range(2, at), 0, *range(at, len(dims) + 1)]))
    merged = [rows, *dims[1:]]
    merged[at - 1] *= tp
    result = _dim_back(graph, graph.call_function(aten.reshape.default, (beside, merged)), order, value.meta["val"])
    # Sizes here are local already: an alias keeps localize from dividing them again.
    return _call(graph, aten.alias.default, (result,), Shard(dst))


def _padded(graph: fx.Graph, value: fx.Node, ndim: int, extra: int) -> fx.Node:
    """``value`` with ``extra`` zero rows appended along dim 0: uneven blocks travel at the longest one's size."""
    if extra == 0:
        return value
    return graph.call_function(aten.constant_pad_nd.default, (value, [0, 0] * (ndim - 1) + [0, extra]))


def _rows(graph: fx.Graph, value: fx.Node, start: int, length: int, total: int) -> fx.Node:
    """Rows ``[start, start + length)`` of dim 0 of a ``total``-row value (itself where that is all of it)."""
    if start == 0 and length == total:
        return value
    return graph.call_function(aten.slice.Tensor, (value, 0, start, start + length))


def _redistribute(
    graph: fx.Graph, value: fx.Node, src: Placement, dst: Placement, *, tp: int, rank: int, group_name: str
) -> fx.Node:
    """Blocks are ``local_block``'s: even where the degree divides the dimension, else ``ceil(n / tp)``
    with a shorter last one. Collectives need equal blocks, so an uneven one is padded to the
    longest before it is sent and the padding is cut off what comes back."""
    shape = value.meta["val"].shape  # global
    ndim = len(shape)
    if isinstance(src, Shard) and isinstance(dst, Shard) and shape[src.dim] % tp == 0 and shape[dst.dim] % tp == 0:
        return _all_to_all(graph, value, src.dim, dst.dim, tp, group_name)
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        # The reduced value comes back contiguous: reduced in its memory order, it keeps its strides.
        layout = memory_layout(value.meta["val"])
        if layout is not None:
            value = graph.call_function(aten.permute.default, (value, layout))
        reduced = activation_collective(graph, c10d.all_reduce.default, (value, "sum", group_name))
        waited = _call(graph, c10d.wait_tensor.default, (reduced,), dst)
        return waited if layout is None else _call(graph, aten.permute.default, (waited, _inverse(layout)), dst)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        longest, length = local_block(shape[dst.dim], tp, 0)[1], local_block(shape[dst.dim], tp, rank)[1]
        dense, order = _dim_first(graph, value, dst.dim, ndim)
        dense = _padded(graph, dense, ndim, longest * tp - shape[dst.dim])
        scattered = activation_collective(graph, c10d.reduce_scatter_tensor.default, (dense, "sum", tp, group_name))
        waited = graph.call_function(c10d.wait_tensor.default, (scattered,))
        result = _dim_back(graph, _rows(graph, waited, 0, length, longest), order, value.meta["val"])
        result.meta["placement"] = dst
        return result
    if isinstance(src, Shard):
        longest, length = local_block(shape[src.dim], tp, 0)[1], local_block(shape[src.dim], tp, rank)[1]
        dense, order = _dim_first(graph, value, src.dim, ndim)
        gathered = activation_collective(
            graph, c10d.all_gather_into_tensor.default, (_padded(graph, dense, ndim, longest - length), tp, group_name)
        )
        waited = graph.call_function(c10d.wait_tensor.default, (gathered,))
        full = _dim_back(graph, _rows(graph, waited, 0, shape[src.dim], longest * tp), order, value.meta["val"])
        full.meta["placement"] = Replicate()
        if isinstance(dst, Replicate):
            return full
        value, src = full, Replicate()
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        start, length = local_block(shape[dst.dim], tp, rank)
        return _call(graph, aten.slice.Tensor, (value, dst.dim, start, start + length), dst)
    raise ValueError(f"dpar internal error: no redistribution from {src} to {dst}")


# [Note: a sequence's two chunks per rank]
# Over a context-parallel axis of ``cp`` ranks a shard is not a contiguous block: each run of
# ``period`` (the sequence length) along the dimension is cut into 2 * cp chunks, and rank r holds
# chunks r and 2 * cp - 1 - r of every run, side by side (torchtitan's head-tail load balancing:
# under a causal mask the early chunks attend to few keys and the late ones to many, so each rank
# gets one of each and the same work). A dimension of ``k * period`` (batch and sequence
# flattened, as before every Linear) holds ``k`` runs, each split alike. Every shard over the axis
# is this layout, so ops that treat the dimension independently need not know it; only moving a
# value in or out of it does: a slice of two chunks, an all-gather followed by putting the chunks
# back in order, or a reduce-scatter of the chunks put in rank order first.


@dataclasses.dataclass(frozen=True)
class BalancedLayout:
    """The layout of a shard over a context-parallel axis: ``size`` ranks, this one, the run length."""

    size: int
    rank: int
    period: int

    @property
    def chunk(self) -> int:
        return self.period // (2 * self.size)

    def runs(self, length: int) -> int:
        return length // self.period


def reversed_along(graph: fx.Graph, value: fx.Node, dim: int, length: int) -> fx.Node:
    """``value`` with its ``length`` entries along ``dim`` in reverse order (slices joined, not ``flip``, which
    Inductor both decomposes and falls back on)."""
    pieces = [call(graph, aten.slice.Tensor, value, dim, i, i + 1) for i in reversed(range(length))]
    return pieces[0] if length == 1 else call(graph, aten.cat.default, pieces, dim)


def _balanced_slice(graph: fx.Graph, value: fx.Node, dim: int, layout: BalancedLayout) -> fx.Node:
    """This rank's two chunks of every run along ``dim`` of a whole (replicated) value."""
    shape = list(value.meta["val"].shape)
    runs, chunk, r = layout.runs(shape[dim]), layout.chunk, layout.rank
    split = call(graph, aten.reshape.default, value, [*shape[:dim], runs, 2 * layout.size, chunk, *shape[dim + 1:]])
    head = call(graph, aten.slice.Tensor, split, dim + 1, r, r + 1)
    tail = call(graph, aten.slice.Tensor, split, dim + 1, 2 * layout.size - 1 - r, 2 * layout.size - r)
    both = call(graph, aten.cat.default, [head, tail], dim + 1)
    return call(graph, aten.reshape.default, both, [*shape[:dim], runs * 2 * chunk, *shape[dim + 1:]])


def _balanced_gather(graph: fx.Graph, value: fx.Node, dim: int, layout: BalancedLayout, group_name: str) -> fx.Node:
    """The whole value from every rank's two chunks per run: all-gathered, then the chunks put back in order
    (rank j's first chunk is chunk j of its run, its second chunk 2 * cp - 1 - j)."""
    val = value.meta["val"]
    shape, cp, chunk = list(val.shape), layout.size, layout.chunk
    runs = layout.runs(shape[dim])
    dense, order = _dim_first(graph, value, dim, len(shape))
    rest = [shape[d] for d in order[1:]]
    gathered = activation_collective(graph, c10d.all_gather_into_tensor.default, (dense, cp, group_name))
    waited = call(graph, c10d.wait_tensor.default, gathered)
    by_rank = call(graph, aten.reshape.default, waited, [cp, runs, 2, chunk, *rest])
    heads = call(graph, aten.select.int, by_rank, 2, 0)  # (cp, runs, chunk, ...): chunks 0 .. cp-1 in rank order
    tails = reversed_along(graph, call(graph, aten.select.int, by_rank, 2, 1), 0, cp)  # chunks cp .. 2cp-1
    chunks = call(graph, aten.cat.default, [heads, tails], 0)  # (2cp, runs, chunk, ...)
    in_order = call(graph, aten.permute.default, chunks, [1, 0, *range(2, 3 + len(rest))])
    whole = call(graph, aten.reshape.default, in_order, [runs * layout.period, *rest])
    return _dim_back(graph, whole, order, val)


def _balanced_scatter(graph: fx.Graph, value: fx.Node, dim: int, layout: BalancedLayout, group_name: str) -> fx.Node:
    """Each rank's two chunks per run of the sum of a partial value: the chunks put in rank order, reduce-scattered."""
    val = value.meta["val"]
    shape, cp, chunk = list(val.shape), layout.size, layout.chunk
    runs = layout.runs(shape[dim])
    dense, order = _dim_first(graph, value, dim, len(shape))
    rest = [shape[d] for d in order[1:]]
    chunks = call(graph, aten.reshape.default, dense, [runs, 2 * cp, chunk, *rest])
    heads = call(graph, aten.slice.Tensor, chunks, 1, 0, cp)
    tails = reversed_along(graph, call(graph, aten.slice.Tensor, chunks, 1, cp, 2 * cp), 1, cp)
    paired = call(graph, aten.cat.default, [call(graph, aten.unsqueeze.default, half, 2) for half in (heads, tails)], 2)
    by_rank = call(graph, aten.permute.default, paired, [1, 0, *range(2, 4 + len(rest))])  # (cp, runs, 2, chunk, ...)
    flat = call(graph, aten.reshape.default, by_rank, [cp * runs * 2 * chunk, *rest])
    scattered = activation_collective(graph, c10d.reduce_scatter_tensor.default, (flat, "sum", cp, group_name))
    waited = call(graph, c10d.wait_tensor.default, scattered)
    return _dim_back(graph, waited, order, val)


def _balanced(
    graph: fx.Graph, value: fx.Node, src: Placement, dst: Placement, layout: BalancedLayout, group_name: str
) -> fx.Node:
    """``_redistribute`` for a context-parallel axis: a shard moves to another dimension through the whole value."""
    if isinstance(src, Partial):
        result = _balanced_scatter(graph, value, dst.dim, layout, group_name)
    else:
        if isinstance(src, Shard):
            whole = _balanced_gather(graph, value, src.dim, layout, group_name)
            whole.meta["val"] = value.meta["val"]
            if isinstance(dst, Replicate):
                whole.meta["placement"] = dst
                return whole
            value = whole
        result = _balanced_slice(graph, value, dst.dim, layout)
    # Sizes here are local already: an alias keeps localize from dividing them again.
    return _call(graph, aten.alias.default, (result,), dst)
