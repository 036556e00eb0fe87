"""Attention on 1/cp of the heads over whole sequences (Ulysses), where propagation chose that exchange.

See [Note: two ways to exchange a sequence for attention] in ``compiler/propagation/context_rules.py``.
Runs on the localized graph: each attention op tagged ``all_to_all`` reads this rank's two chunks of every
head's sequence; the pass moves its tensors to every token of this rank's heads (one all-to-all each, the
chunks then put in global order), runs the same kernel there (its causal flag is right on global order), and
moves what it returns back to this rank's chunks. A tensor exchanged once is exchanged once: the backward
reads the forward's exchanged queries, keys, values, output and log-sum-exp.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dpar.compiler.graph_utils import call
from dpar.compiler.propagation.context_rules import ATTENTION_EXCHANGE, undetached
from dpar.compiler.propagation.redistribute import (
    BalancedLayout,
    activation_collective,
    dense_in,
    memory_layout,
    reversed_along,
)
from dpar.compiler.propagation.rules import ATTENTION_BACKWARD, MASK_ARGUMENTS, argument
from dpar.core.plan import ALL_TO_ALL
from dpar.core.torch_internals import C10D_FUNCTIONAL

aten = torch.ops.aten


def _exchange(graph: fx.Graph, send: fx.Node, cp: int, group_name: str) -> fx.Node:
    """One all-to-all of ``send``, contiguous, whose dim 0 is the destination rank: dim 0 of the result is the source."""
    dense = call(graph, aten.clone.default, send, memory_format=torch.contiguous_format)
    moved = activation_collective(graph, C10D_FUNCTIONAL.all_to_all_single.default, (dense, [1] * cp, [1] * cp, group_name))
    return call(graph, C10D_FUNCTIONAL.wait_tensor.default, moved)


def to_heads(graph: fx.Graph, value: fx.Node, shape: list[int], layout: BalancedLayout, group_name: str) -> fx.Node:
    """``(batch, heads, 2 chunks, *rest)`` of this rank -> ``(batch, heads / cp, seq, *rest)`` in global order.

    ``shape`` is the global one. Rank j is sent head block j of both chunks; from rank s come chunks s and
    2cp - 1 - s of this rank's heads, so the heads of the received are chunks 0 .. cp-1 in rank order and the tails
    chunks 2cp-1 .. cp.
    """
    cp, chunk = layout.size, layout.chunk
    batch, heads, _, *rest = shape
    ends = list(range(4, 4 + len(rest)))
    by_block = call(graph, aten.view.default, value, [batch, cp, heads // cp, 2 * chunk, *rest])
    received = _exchange(graph, call(graph, aten.permute.default, by_block, [1, 0, 2, 3, *ends]), cp, group_name)
    halves = call(graph, aten.view.default, received, [cp, batch, heads // cp, 2, chunk, *rest])
    first = call(graph, aten.select.int, halves, 3, 0)
    second = reversed_along(graph, call(graph, aten.select.int, halves, 3, 1), 0, cp)
    chunks = call(graph, aten.cat.default, [first, second], 0)  # (2cp, batch, heads / cp, chunk, *rest)
    ordered = call(graph, aten.permute.default, chunks, [1, 2, 0, 3, *ends])
    return call(graph, aten.reshape.default, ordered, [batch, heads // cp, 2 * cp * chunk, *rest])


def to_chunks(graph: fx.Graph, value: fx.Node, shape: list[int], layout: BalancedLayout, group_name: str) -> fx.Node:
    """The inverse of ``to_heads``: ``(batch, heads / cp, seq, *rest)`` -> this rank's ``(batch, heads, 2 chunks, *rest)``."""
    cp, chunk = layout.size, layout.chunk
    batch, heads, _, *rest = shape
    ends = list(range(4, 4 + len(rest)))
    chunks = call(graph, aten.view.default, value, [batch, heads // cp, 2 * cp, chunk, *rest])
    first = call(graph, aten.slice.Tensor, chunks, 2, 0, cp)  # rank j's head chunk at j
    second = reversed_along(graph, call(graph, aten.slice.Tensor, chunks, 2, cp, 2 * cp), 2, cp)  # its tail at j
    # (batch, heads / cp, cp, 2, chunk, *rest); not ``stack``, which Inductor both decomposes and falls back on
    paired = call(graph, aten.cat.default, [call(graph, aten.unsqueeze.default, half, 3) for half in (first, second)], 3)
    received = _exchange(graph, call(graph, aten.permute.default, paired, [2, 0, 1, 3, 4, *(e + 1 for e in ends)]), cp,
                         group_name)  # (cp: head block, batch, heads / cp, 2, chunk, *rest)
    merged = call(graph, aten.permute.default, received, [1, 0, 2, 3, 4, *(e + 1 for e in ends)])
    return call(graph, aten.reshape.default, merged, [batch, heads, 2 * chunk, *rest])


def exchange_heads(gm: fx.GraphModule, layout: BalancedLayout, group_name: str) -> fx.GraphModule:
    """Every attention op propagation tagged ``all_to_all`` rewritten to run on this rank's heads of whole sequences."""
    graph = gm.graph
    in_heads: dict[fx.Node, fx.Node] = {}  # a split value -> its exchanged form (made once, read by the backward too)

    def heads_of(value: fx.Node) -> fx.Node:
        source = undetached(value)
        if source not in in_heads:
            in_heads[source] = to_heads(graph, value, list(value.meta["val"].shape), layout, group_name)
        return in_heads[source]

    for node in list(graph.nodes):
        if node.meta.get(ATTENTION_EXCHANGE) != ALL_TO_ALL:
            continue
        mask = argument(node, MASK_ARGUMENTS)
        exchanged = [a for a in node.args if isinstance(a, fx.Node) and a is not mask]
        with graph.inserting_before(node):
            args = tuple(heads_of(a) if a in exchanged else a for a in node.args)
            kwargs = dict(node.kwargs)
            if isinstance(mask, fx.Node) and mask.meta["val"].dim() == 4 and mask.meta["val"].shape[1] > 1:
                per_rank = mask.meta["val"].shape[1] // layout.size  # a mask per head: this rank's heads
                kwargs["attn_mask"] = call(graph, aten.slice.Tensor, mask, 1, layout.rank * per_rank,
                                           (layout.rank + 1) * per_rank)
            computed = graph.call_function(node.target, args, kwargs)
        vals = node.meta["val"]
        for user in list(node.users):
            index = user.args[1]
            val = vals[index]
            with graph.inserting_before(user):
                result = call(graph, operator.getitem, computed, index)
                if val.dim() < 3:
                    back = result
                else:
                    back = to_chunks(graph, result, list(val.shape), layout, group_name)
                    layout_in_memory = memory_layout(val)  # the ops after it were traced on the kernel's strides
                    back = back if layout_in_memory is None else dense_in(graph, back, layout_in_memory)
            user.replace_all_uses_with(back)
            graph.erase_node(user)
            if node.target not in ATTENTION_BACKWARD:
                in_heads[back] = result
        graph.erase_node(node)
    return gm
