"""The context-parallel pass: from the joint graph of the single-device program to one rank's share of each sequence.

See [Note: a sequence split over a context-parallel group] in ``runtime/context_parallel.py``.
Before AOTAutograd, ``mark_sequences`` reads the user's sequence-long inputs through
``dpar::sequence_split``. On the joint graph, ``context_parallel_pass`` makes explicit
what a split changes the meaning of, then lets sharding propagation place every value:

- causal attention (``is_causal=True``) gets its mask spelled out from global positions,
  so that each rank's queries see the keys before them in the whole sequence (the kernel's
  own flag would mask by local positions);
- a loss averaged over tokens becomes the sum over tokens divided by the count of valid
  ones, two partial sums reduced over the group: the mean over the whole sequence, not a
  mean of the ranks' means (which differ once padding or ignored labels are uneven).

Labels that a model shifts itself (Hugging Face's losses pad and slice them) are shifted
while whole: propagation gathers the integer labels for the pad and hands each rank its
chunks of the shifted ones, so no token's label comes from the wrong side of a chunk.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from dpar.compiler.graph_utils import refresh_fake_values
from dpar.compiler.passes.group_batch import OWN_ROWS
from dpar.compiler.passes.tensor_parallel import split_addmm
from dpar.compiler.propagation.localize import localize
from dpar.compiler.propagation.propagate import MeshDim, propagate_placements
from dpar.compiler.propagation.rules import ATTENTION, ATTENTION_BACKWARD
from dpar.core.errors import ContextParallelError
from dpar.runtime.context_parallel import SEQUENCE_SPLIT

aten = torch.ops.aten

SEQUENCE_DIM = 1
"""Where a sequence-long input holds its tokens: (batch, seq, ...), as Hugging Face, nanoGPT and torchtitan feed them."""

_FOLLOWED = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}
_MEAN, _SUM = 1, 2


def _value(node: fx.Node) -> object:
    return node.meta.get("example_value", node.meta.get("val"))


def sequence_length(gm: fx.GraphModule, data: Sequence[int], cp: int) -> int:
    """The sequence length: dim 1 of the first user input of two or more dims, which two chunks per rank must divide."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [v for v in (_value(placeholders[i]) for i in data) if isinstance(v, torch.Tensor) and v.dim() >= 2]
    if not tensors:
        raise ContextParallelError(
            "context parallel splits the sequence dimension (dim 1) of the inputs, but the compiled function takes "
            "no tensor of two or more dimensions: feed (batch, seq) token ids, as for DDP"
        )
    length = tensors[0].shape[SEQUENCE_DIM]
    if not isinstance(length, int):
        raise ContextParallelError(
            "context parallel needs a static sequence length; Dynamo traced it as a symbol. Compile with "
            "dynamic=False (and pad batches to one length)"
        )
    if length % (2 * cp):
        raise ContextParallelError(
            f"the sequence length {length} is not divisible by 2 x cp = {2 * cp}: each of the {cp} ranks holds two "
            f"chunks of every sequence (head and tail). Pad or cut the sequences to a multiple of {2 * cp}"
        )
    return length


def mark_sequences(gm: fx.GraphModule, data: Sequence[int], length: int) -> fx.GraphModule:
    """Read every user input whose dim 1 is ``length`` long through ``dpar::sequence_split`` (after
    ``dpar::own_rows``, where the group's rows are moved)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index in data:
        node = placeholders[index]
        val = _value(node)
        if not (isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[SEQUENCE_DIM] == length):
            continue
        read = next((u for u in node.users if u.target is OWN_ROWS), node)
        with gm.graph.inserting_after(read):
            split = gm.graph.call_function(SEQUENCE_SPLIT, (read, SEQUENCE_DIM))
        read.replace_all_uses_with(split, delete_user_cb=lambda user: user is not split)
    gm.recompile()
    return gm


def _argument_index(node: fx.Node, name: str) -> int:
    return next(i for i, a in enumerate(node.target._schema.arguments) if a.name == name)


def _call(graph: fx.Graph, target: object, *args: object, **kwargs: object) -> fx.Node:
    return graph.call_function(target, args, kwargs)


def _causal_mask(graph: fx.Graph, query: fx.Node, length: int) -> fx.Node:
    """``(seq, seq)`` additive mask, 0 where a query's global position is at or after the key's, else -inf;
    its rows (the queries) start split, so no rank builds the whole of it."""
    val = query.meta["val"]
    positions = _call(graph, aten.arange.default, length, dtype=torch.int64, device=val.device)
    rows = _call(graph, aten.unsqueeze.default, _call(graph, SEQUENCE_SPLIT, positions, 0), 1)
    allowed = _call(graph, aten.ge.Tensor, rows, _call(graph, aten.unsqueeze.default, positions, 0))
    mask = _call(graph, aten.where.Scalar, allowed, 0.0, float("-inf"))
    return mask if val.dtype == torch.float32 else _call(graph, aten._to_copy.default, mask, dtype=val.dtype)


def explicit_causal_masks(gm: fx.GraphModule, length: int) -> fx.GraphModule:
    """Every causal attention (forward and backward) with its mask spelled out from global positions."""
    graph = gm.graph
    masks: dict[fx.Node, fx.Node] = {}  # query -> its mask
    for node in list(graph.nodes):
        if node.target not in ATTENTION | ATTENTION_BACKWARD:
            continue
        if node.target not in _FOLLOWED:
            raise ContextParallelError(
                f"context parallel splits attention computed by {node.target}, which its pass does not follow yet "
                "(it follows scaled_dot_product_attention's CPU kernel and attention written out, as "
                "attn_implementation='eager' does). On a GPU, run under "
                "torch.nn.attention.sdpa_kernel(SDPBackend.MATH) or choose eager attention"
            )
        backward = node.target in ATTENTION_BACKWARD
        query = node.args[1] if backward else node.args[0]
        causal_at = _argument_index(node, "is_causal")
        causal = node.args[causal_at] if causal_at < len(node.args) else node.kwargs.get("is_causal", False)
        if not causal:
            continue
        if node.kwargs.get("attn_mask") is not None:
            raise ContextParallelError(f"{node}: attention with both a mask and is_causal=True; pass one of them")
        key = node.args[2] if backward else node.args[1]
        if query.meta["val"].shape[2] != key.meta["val"].shape[2]:
            raise ContextParallelError(
                f"{node}: causal attention of {query.meta['val'].shape[2]} queries over {key.meta['val'].shape[2]} "
                "keys (a cache or cross attention); context parallel splits self-attention over one sequence"
            )
        if query not in masks:
            with graph.inserting_before(node):
                masks[query] = _causal_mask(graph, query, length)
        args = list(node.args)
        args[causal_at] = False
        node.args = tuple(args)
        node.kwargs = {**node.kwargs, "attn_mask": masks[query]}
    return gm


def loss_as_sum_and_count(gm: fx.GraphModule) -> fx.GraphModule:
    """``nll_loss`` averaged over tokens -> summed, divided by the count of valid targets (its ``total_weight``)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not aten.nll_loss_forward.default or node.args[3] != _MEAN:
            continue
        node.args = (*node.args[:3], _SUM, *node.args[4:])
        picked = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        with graph.inserting_after(node):
            count = picked.get(1) or graph.call_function(operator.getitem, (node, 1))
        total = picked.get(0)
        if total is None:
            continue
        with graph.inserting_after(max(total, count, key=lambda n: _position(graph, n))):
            mean = graph.call_function(aten.div.Tensor, (total, count))
        total.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)
    return gm


def _position(graph: fx.Graph, node: fx.Node) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n is node)


def context_parallel_pass(gm: fx.GraphModule, mesh: MeshDim) -> fx.GraphModule:
    """Masks and the loss made explicit, placements propagated from the markers, the graph rewritten to local shapes."""
    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    gm = loss_as_sum_and_count(explicit_causal_masks(split_addmm(gm), mesh.period))
    gm.recompile()
    refresh_fake_values(gm, placeholders)
    gm = localize(propagate_placements(gm, mesh), mesh)
    gm.recompile()
    refresh_fake_values(gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])
    return gm
