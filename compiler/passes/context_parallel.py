"""The context-parallel pass: from the joint graph of the single-device program to one rank's share of each sequence.

See [Note: a sequence split over a context-parallel group] in ``runtime/context_parallel.py``.
Before AOTAutograd, ``mark_sequences`` reads the user's sequence-long inputs through
``dpar::sequence_split``. On the joint graph, ``context_parallel_pass`` makes explicit
what a split changes the meaning of, then lets sharding propagation place every value:

- causal attention (``is_causal=True``) on this rank's two chunks is computed per chunk:
  causally over the chunk's own keys, fully over the keys before it, merged by their
  log-sum-exps (the kernel's own flag would mask by local positions, and a mask from
  global positions would hold ``seq / cp x seq`` elements);
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
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import CheckpointPolicy

from dpar.compiler.graph_utils import call, refresh_fake_values, with_code
from dpar.compiler.passes.group_batch import OWN_ROWS
from dpar.compiler.passes.heads_exchange import exchange_heads
from dpar.compiler.passes.tensor_parallel import split_addmm
from dpar.compiler.propagation.localize import localize
from dpar.compiler.passes.recompute import RECOMPUTE_KEY
from dpar.compiler.passes.sequence_parallel import tag_sequence_gathers_for_recompute
from dpar.compiler.propagation.propagate import MeshDim, propagate_placements
from dpar.compiler.propagation.redistribute import BalancedLayout, dense_in, memory_layout
from dpar.compiler.propagation.rules import ATTENTION, ATTENTION_BACKWARD, argument
from dpar.core.errors import ContextParallelError
from dpar.runtime.context_parallel import SEQUENCE_SPLIT

aten = torch.ops.aten

SEQUENCE_DIM = 1
"""Where a sequence-long input holds its tokens: (batch, seq, ...), as Hugging Face, nanoGPT and torchtitan feed them."""

FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
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
    return with_code(gm)


def marked_length(gm: fx.GraphModule) -> int:
    """The sequence length ``mark_sequences`` split the inputs by, read off its markers."""
    marker = next(n for n in gm.graph.nodes if n.target is SEQUENCE_SPLIT)
    return marker.args[0].meta["val"].shape[marker.args[1]]


def check_attention(gm: fx.GraphModule) -> fx.GraphModule:
    """Every attention in the graph is one the pass splits exactly: the CPU kernel (or attention written out,
    which propagation follows op by op), without dropout, causal only over one sequence."""
    for node in gm.graph.nodes:
        if node.target not in ATTENTION | ATTENTION_BACKWARD:
            continue
        if node.target not in (FLASH, FLASH_BACKWARD):
            raise ContextParallelError(
                f"context parallel splits attention computed by {node.target}, which its pass does not follow yet "
                "(it follows scaled_dot_product_attention's CPU kernel and attention written out, as "
                "attn_implementation='eager' does). On a GPU, run under "
                "torch.nn.attention.sdpa_kernel(SDPBackend.MATH) or choose eager attention"
            )
        backward = node.target is FLASH_BACKWARD
        query, key = node.args[1:3] if backward else node.args[0:2]
        if argument(node, ("dropout_p",)):
            raise ContextParallelError(
                f"{node}: attention dropout under context parallel (each rank would draw its own mask over its "
                "chunks); set the model's attention dropout to 0"
            )
        if argument(node, ("is_causal",)) and query.meta["val"].shape[2] != key.meta["val"].shape[2]:
            raise ContextParallelError(
                f"{node}: causal attention of {query.meta['val'].shape[2]} queries over {key.meta['val'].shape[2]} "
                "keys (a cache or cross attention); context parallel splits self-attention over one sequence"
            )
    return gm


def _chunks(layout: BalancedLayout) -> tuple[int, int]:
    """The global indices of this rank's two chunks of a sequence: head, tail."""
    return layout.rank, 2 * layout.size - 1 - layout.rank


def _along(graph: fx.Graph, value: fx.Node, start: int, end: int) -> fx.Node:
    return call(graph, aten.slice.Tensor, value, 2, start, end)


def _log_add_exp(graph: fx.Graph, a: fx.Node, b: fx.Node) -> fx.Node:
    """``log(exp(a) + exp(b))`` from ops every backend lowers (Inductor refuses ``logaddexp`` already decomposed)."""
    top = call(graph, aten.maximum.default, a, b)
    total = call(graph, aten.add.Tensor, *(call(graph, aten.exp.default, call(graph, aten.sub.Tensor, x, top)) for x in (a, b)))
    return call(graph, aten.add.Tensor, top, call(graph, aten.log.default, total))


def _causal_forward(graph: fx.Graph, node: fx.Node, layout: BalancedLayout) -> tuple[fx.Node, fx.Node]:
    """(output, log-sum-exp) of this rank's queries under a causal mask over global positions: per chunk ``c``,
    causal attention to chunk ``c``'s keys and full attention to the keys before it, merged by their log-sum-exps."""
    query, key, value = node.args[:3]
    scale, length = node.kwargs.get("scale"), layout.chunk
    outs, lses = [], []
    for half, chunk in enumerate(_chunks(layout)):
        q = _along(graph, query, half * length, (half + 1) * length)
        keys = (chunk * length, (chunk + 1) * length)
        own = call(graph, FLASH, q, _along(graph, key, *keys), _along(graph, value, *keys), 0.0, True, scale=scale)
        out, lse = call(graph, operator.getitem, own, 0), call(graph, operator.getitem, own, 1)
        if chunk:
            before = call(graph, FLASH, q, _along(graph, key, 0, keys[0]), _along(graph, value, 0, keys[0]),
                          0.0, False, scale=scale)
            out_before, lse_before = call(graph, operator.getitem, before, 0), call(graph, operator.getitem, before, 1)
            merged = _log_add_exp(graph, lse_before, lse)
            weights = [call(graph, aten.unsqueeze.default, call(graph, aten.exp.default,
                                                                call(graph, aten.sub.Tensor, part, merged)), -1)
                       for part in (lse_before, lse)]
            dtype = query.meta["val"].dtype
            if dtype != torch.float32:
                weights = [call(graph, aten._to_copy.default, w, dtype=dtype) for w in weights]
            out = call(graph, aten.add.Tensor, call(graph, aten.mul.Tensor, out_before, weights[0]),
                       call(graph, aten.mul.Tensor, out, weights[1]))
            lse = merged
        outs.append(out)
        lses.append(lse)
    return call(graph, aten.cat.default, outs, 2), call(graph, aten.cat.default, lses, 2)


def _causal_backward(graph: fx.Graph, node: fx.Node, layout: BalancedLayout) -> tuple[fx.Node, fx.Node, fx.Node]:
    """The gradients of ``_causal_forward``'s pieces, each from the merged output and log-sum-exp (which make a
    piece's probabilities the whole attention's, restricted to its keys): the queries' per chunk, the keys' and
    values' (whole sequences, partial sums over the group) added up over the pieces."""
    grad, query, key, value, out, lse = node.args[:6]
    scale, length, period = node.kwargs.get("scale"), layout.chunk, layout.period
    grad_queries, grad_keys, grad_values = [], [], []
    for half, chunk in enumerate(_chunks(layout)):
        rows = (half * length, (half + 1) * length)
        g, q, o = (_along(graph, t, *rows) for t in (grad, query, out))
        m = _along(graph, lse, *rows)
        keys = (chunk * length, (chunk + 1) * length)
        pieces = [(keys, True)] + ([((0, keys[0]), False)] if chunk else [])
        dq = None
        for (start, end), causal in pieces:
            grads = call(graph, FLASH_BACKWARD, g, q, _along(graph, key, start, end), _along(graph, value, start, end),
                         o, m, 0.0, causal, scale=scale)
            piece_dq, dk, dv = (call(graph, operator.getitem, grads, i) for i in range(3))
            dq = piece_dq if dq is None else call(graph, aten.add.Tensor, dq, piece_dq)
            padding = [0, 0, start, period - end]  # back to the whole sequence: zeros elsewhere
            grad_keys.append(call(graph, aten.constant_pad_nd.default, dk, padding))
            grad_values.append(call(graph, aten.constant_pad_nd.default, dv, padding))
        grad_queries.append(dq)
    total_keys, total_values = grad_keys[0], grad_values[0]
    for dk, dv in zip(grad_keys[1:], grad_values[1:]):
        total_keys = call(graph, aten.add.Tensor, total_keys, dk)
        total_values = call(graph, aten.add.Tensor, total_values, dv)
    return call(graph, aten.cat.default, grad_queries, 2), total_keys, total_values


def causal_attention_by_chunks(gm: fx.GraphModule, layout: BalancedLayout) -> fx.GraphModule:
    """Split causal attention (now on this rank's queries) computed as ``_causal_forward`` / ``_causal_backward``:
    the kernel's own causal flag would mask by local positions, and a mask from global positions would cost
    ``seq / cp x seq`` elements per sequence."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target not in (FLASH, FLASH_BACKWARD) or not argument(node, ("is_causal",)):
            continue
        query = 1 if node.target is FLASH_BACKWARD else 0
        if node.meta.get("placement_inputs", (None, None))[query] != Shard(2):
            continue  # whole on every rank: the kernel's flag is right
        with graph.inserting_before(node):
            results = (_causal_backward if node.target is FLASH_BACKWARD else _causal_forward)(graph, node, layout)
            # In the kernel's memory layout: the ops after it were traced on its strides (a view after a transpose).
            results = tuple(r if memory_layout(v) is None else dense_in(graph, r, memory_layout(v))
                            for r, v in zip(results, node.meta["val"]))
        for user in list(node.users):
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
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


def save_split_indices(gm: fx.GraphModule) -> fx.GraphModule:
    """This rank's chunks of integer inputs (token ids, labels) are saved for the backward, not cut again there:
    Inductor's CPU code generation fails on a scatter (an embedding's gradient) indexed through the cut
    (a vectorized int64 index it asserts on), and the chunks are small."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if (node.target is aten.alias.default and isinstance(node.meta.get("placement"), Shard)
                and isinstance(val, torch.Tensor) and not val.dtype.is_floating_point):
            node.meta[RECOMPUTE_KEY] = CheckpointPolicy.MUST_SAVE
    return gm


def context_parallel_pass(gm: fx.GraphModule, mesh: MeshDim) -> fx.GraphModule:
    """The loss made a sum and a count, placements propagated from the markers, the graph rewritten to local
    shapes, attention exchanged to heads where propagation chose it, else causal attention computed by chunks;
    the keys' and values' all-gathers are done again in the backward instead of saved (what is saved is this
    rank's chunks)."""
    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    gm = loss_as_sum_and_count(check_attention(split_addmm(gm)))
    refresh_fake_values(gm, placeholders)
    gm = localize(propagate_placements(gm, mesh), mesh)
    layout = BalancedLayout(mesh.size, mesh.rank, mesh.period)
    gm = causal_attention_by_chunks(exchange_heads(gm, layout, mesh.group_name), layout)
    gm.graph.lint()
    refresh_fake_values(gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])
    return with_code(save_split_indices(tag_sequence_gathers_for_recompute(gm, mesh.group_name)))
