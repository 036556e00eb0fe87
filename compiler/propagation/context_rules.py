"""Sharding rules over a context-parallel axis, where a shard is a sequence's balanced chunks.

Most ops take ``rules.RULES``' candidates unchanged: an op that treats a dimension
independently computes its share of a balanced shard as of a block. What differs:

- A shard lives only on a dimension of whole runs of the sequence (``k * period``):
  any candidate naming another is dropped, so the layout is defined wherever it is used.
- Views carry a shard through a flattening when it is the *innermost* dimension of its
  run (``(batch, seq, hidden) -> (batch * seq, hidden)``, before every Linear), where
  tensor parallel's blocks need the outermost; the token index is then ``b * seq + s``.
- Attention runs on this rank's queries against every key and value (all-gathered;
  their gradients come back as partial sums, reduce-scattered): the mask's rows are
  the queries', so a causal mask from global positions stays right. Or on 1/cp of the
  heads over whole sequences, exchanged by all-to-alls (see [Note: two ways to exchange
  a sequence for attention]).
- An embedding looked up with split indices is split alike; its weight gradient is a
  partial sum over the group's tokens. So is a loss summed over tokens, with the count
  of valid tokens beside it (``passes/context_parallel.py`` rewrites a mean into both).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from dpar.compiler.propagation.rules import (
    ATTENTION,
    ATTENTION_BACKWARD,
    POINTWISE,
    P,
    R,
    MASK_ARGUMENTS,
    Candidate,
    argument,
    broadcast_placement,
    candidates_for,
    replicated,
    shape_of,
    tensor_inputs,
    view_groups,
)
from dpar.compiler.propagation.redistribute import cost, nbytes_of
from dpar.core.errors import ContextParallelError
from dpar.core.plan import ALL_GATHER, ALL_TO_ALL
from dpar.runtime.context_parallel import SEQUENCE_SPLIT

aten = torch.ops.aten
SEQUENCE = Shard(2)
"""Attention's tensors, ``(batch, heads, seq, ...)``, split by the sequence."""

_REDUCTION_SUM = 2


def _innermost(dims: list[int], shape: tuple[int, ...]) -> int | None:
    return next((d for d in reversed(dims) if shape[d] != 1), None)


def view(node: fx.Node, period: int) -> list[Candidate]:
    """A shard stays one through a view where it is the innermost dimension of its run and lands on the
    innermost dimension of the matching run, a whole number of sequences long."""
    source = tensor_inputs(node)[0]
    here = source.meta.get("placement", R)
    if not isinstance(here, Shard):
        return [Candidate((here,), (here,))]
    before, after = shape_of(source), shape_of(node)
    for gi, gj in view_groups(before, after):
        if here.dim in gi:
            target = _innermost(gj, after)
            if _innermost(gi, before) == here.dim and target is not None and after[target] % period == 0:
                return [Candidate((here,), (Shard(target),)), Candidate((R,), (R,))]
    return [Candidate((R,), (R,))]


ATTENTION_EXCHANGE = "dpar_attention_exchange"
"""``node.meta`` key on a split attention op: which exchange propagation chose for it (``ALL_GATHER`` or ``ALL_TO_ALL``)."""

# [Note: two ways to exchange a sequence for attention]
# Attention needs every key of a sequence for each query; under cp each rank holds two chunks of all of them.
# - all_gather: this rank's queries attend to keys and values all-gathered whole (torchtitan's default); their
#   gradients, partial sums over the group, are reduce-scattered back. The gathers run again in the backward.
#   A grouped-query model gathers its key-value heads before they are repeated, so it moves kv_heads / heads
#   of the bytes: (cp - 1) / cp of keys and values, three times.
# - all_to_all (Ulysses): queries, keys and values move from "my chunks, every head" to "every token, my
#   heads" by one all-to-all each; the kernel runs on heads / cp heads of the whole sequence in its global
#   order (so a causal flag is right as it stands), and the output and log-sum-exp move back; the backward
#   moves the output's gradient in and the three gradients out, reusing the forward's exchanged tensors.
#   Each all-to-all moves (cp - 1) / cp of the local block: a 1 / cp of what a gather of it moves, for eight
#   tensors (repeated keys and values included). It needs the heads (after any repeat) divisible by cp.
# Propagation prices both at each forward attention (``Candidate.inner``: the collectives the op's rewrite runs
# itself, beside what its inputs cost to reach) and takes the cheaper; its backward takes the forward's choice.
# Priced on the forward's exchange, all_to_all wins for multi-head attention from cp 4 (4 / cp of a tensor's bytes
# against 2 for the gathers, times (cp - 1) / cp), for 4 query heads a key-value head above cp 8, and a latency per
# collective (5 against 2) keeps the gathers for short sequences. Over forward and backward the all-to-alls move
# less from cp 2 (8 / cp against 6), as the planner prices them; pricing the backward here too would make the
# whole attention on every rank (``replicated``, priced by its forward gathers) look cheapest, which it is not.
# An attention reading a mask of a row per query (Hugging Face's causal and padding masks) keeps all_gather unless
# asked: by heads each rank needs every row of it, seq x seq, where the gather builds this rank's rows (the term
# that grows fastest with the sequence). ``parallelize(attention_exchange=...)`` fixes one for every attention.


def attention(node: fx.Node, size: int, period: int, exchange: str | None) -> list[Candidate]:
    """This rank's queries (dim 2 of ``(batch, heads, seq, head_dim)``) against every key and value: gathered
    whole, or exchanged to whole sequences of 1/cp of the heads (see the Note). ``exchange`` fixes one."""
    backward = node.target in ATTENTION_BACKWARD
    query = node.args[1] if backward else node.args[0]
    if query.meta.get("placement") != SEQUENCE and not (backward and node.args[0].meta.get("placement") == SEQUENCE):
        return replicated(node, 0)
    chosen = _forward_choice(node) if backward else exchange
    gathered, exchanged = _gathered(node, size), _exchanged_heads(node, size, period)
    if chosen == ALL_TO_ALL and exchanged is None:
        raise ContextParallelError(
            f"{node}: attention_exchange='all_to_all' runs each attention on heads / cp of the heads, but its "
            f"{_why_not_by_heads(node, size, period)}; use attention_exchange='all_gather' (or leave it to the cost model)"
        )
    if chosen == ALL_TO_ALL:  # asked for: not the whole attention on every rank, which its latency may undercut
        return [exchanged]
    if chosen is None and _reads_a_whole_mask(node, period):
        exchanged = None
    found = [gathered] if chosen == ALL_GATHER or exchanged is None else [gathered, exchanged]
    return found + replicated(node, 0)


def _tensors(node: fx.Node) -> tuple[torch.Tensor | None, ...]:
    vals = node.meta["val"]
    return tuple(v if isinstance(v, torch.Tensor) else None for v in (vals if isinstance(vals, (tuple, list)) else (vals,)))


def _forward_choice(backward: fx.Node) -> str | None:
    """The exchange the forward of an attention backward took (its output is the backward's fifth input)."""
    out = undetached(backward.args[4])
    forward = out.args[0] if out.target is operator.getitem else None
    return forward.meta.get(ATTENTION_EXCHANGE) if isinstance(forward, fx.Node) else None


def undetached(value: fx.Node) -> fx.Node:
    """``value`` before the ``detach``es AOTAutograd puts between a forward's output and the backward reading it."""
    while value.target is aten.detach.default:
        value = value.args[0]
    return value


def _gathered(node: fx.Node, size: int) -> Candidate:
    """Queries split, keys and values whole (the mask split by rows, whole where it broadcasts over them);
    backward: the gradient of the queries split, those of the keys and values partial sums, reduce-scattered
    (priced here: their consumers only see a partial sum)."""
    backward = node.target in ATTENTION_BACKWARD
    key, value = node.args[2:4] if backward else node.args[1:3]
    mask = argument(node, MASK_ARGUMENTS)
    ins = tuple(R if n is key or n is value else broadcast_placement(4, shape_of(n), SEQUENCE) if n is mask else SEQUENCE
                for n in tensor_inputs(node))
    if backward:  # grad_query, grad_key, grad_value (and a mask's gradient, which cp refuses before here)
        outs = tuple((SEQUENCE if i == 0 else P) if v is not None else None for i, v in enumerate(_tensors(node)))
        inner = sum(cost(P, SEQUENCE, gathered_bytes(n), size) for n in (key, value))
    else:  # out, logsumexp (batch, heads, seq), then seeds and sizes
        outs = tuple((SEQUENCE if v.dim() >= 3 else R) if v is not None else None for v in _tensors(node))
        inner = 0.0
    return Candidate(ins, outs, name=ALL_GATHER, inner=inner)


def _exchanged_heads(node: fx.Node, size: int, period: int) -> Candidate | None:
    """Every tensor split by the sequence as it is, the mask whole; the op's rewrite
    (``passes/heads_exchange.py``) exchanges them to heads and back. None where the op cannot run so."""
    if _why_not_by_heads(node, size, period):
        return None
    backward = node.target in ATTENTION_BACKWARD
    mask = argument(node, MASK_ARGUMENTS)
    inputs = tensor_inputs(node)
    ins = tuple(R if n is mask else SEQUENCE for n in inputs)
    outs = tuple((SEQUENCE if v.dim() >= 3 else R) if v is not None else None for v in _tensors(node))
    moved_in = inputs[:1] if backward else inputs[:3]  # the backward reuses the forward's exchanged tensors
    inner = sum(cost(SEQUENCE, Shard(1), nbytes_of(n), size) for n in moved_in) + sum(
        cost(SEQUENCE, Shard(1), v.numel() * v.element_size(), size) for v in _tensors(node) if v is not None and v.dim() >= 3)
    return Candidate(ins, outs, name=ALL_TO_ALL, inner=inner)


def _reads_a_whole_mask(node: fx.Node, period: int) -> bool:
    """Whether the op reads a mask with a row per query of the sequence: by heads every rank would build all of it
    (``seq x seq``), where the gather builds this rank's rows only ([Note: slicing before computing])."""
    mask = argument(node, MASK_ARGUMENTS)
    return isinstance(mask, fx.Node) and len(shape_of(mask)) >= 2 and shape_of(mask)[-2] == period


def _why_not_by_heads(node: fx.Node, size: int, period: int) -> str:
    """Why the op cannot run on heads / cp heads of whole sequences ('' where it can)."""
    backward = node.target in ATTENTION_BACKWARD
    mask = argument(node, MASK_ARGUMENTS)
    per_head = [n for n in tensor_inputs(node) if n is not mask and len(shape_of(n)) >= 3]
    heads = {shape_of(n)[1] for n in per_head}
    if any(h % size for h in heads):
        return f"heads ({', '.join(map(str, sorted(heads)))}) are not divisible by cp = {size}"
    if any(shape_of(n)[2] != period for n in per_head):
        return f"tensors do not hold one sequence of {period} tokens along dim 2"
    if isinstance(mask, fx.Node) and len(shape_of(mask)) == 4 and shape_of(mask)[1] not in (1, *heads):
        return f"mask has {shape_of(mask)[1]} heads"
    if backward and _forward_choice(node) is None:
        return "forward was not exchanged by heads"
    return ""


def embedding(node: fx.Node, period: int) -> list[Candidate]:
    """Split indices look up split rows of a whole table."""
    weight, indices = tensor_inputs(node)[:2]
    here = indices.meta.get("placement", R)
    if weight.meta.get("placement", R) == R and isinstance(here, Shard):
        return [Candidate((R, here), (Shard(here.dim),))]
    return replicated(node, 0)


def embedding_backward(node: fx.Node, period: int) -> list[Candidate]:
    """The table's gradient from split tokens (the indices sliced alike where they are whole, as positions
    are): a partial sum. Not with ``scale_grad_by_freq``, which divides by counts over all tokens."""
    grad, indices = tensor_inputs(node)[:2]
    split = next((p for p in (indices.meta.get("placement", R), grad.meta.get("placement", R))
                  if isinstance(p, Shard) and p.dim < len(shape_of(indices))), None)
    scaled = node.args[4] if len(node.args) > 4 else False
    if split is not None and not scaled:
        return [Candidate((split, split), (P,))]  # the gradient's leading dims are the indices'
    return replicated(node, 0)


_ZEROS = {aten.full.default, aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}


def _zeros(node: fx.Node) -> bool:
    """Whether ``node`` makes a tensor of zeros (a gradient's blank before values are written into it)."""
    return node.target in _ZEROS and (node.target is not aten.full.default or node.args[1] == 0)


def masked_index_put(node: fx.Node, period: int) -> list[Candidate] | None:
    """Inductor's form of an embedding's gradient: values added into a table of zeros at split indices give a
    partial sum of the table (only into zeros: a table with values of its own would be counted cp times)."""
    table, mask = node.args[:2]
    (indices,) = node.args[2]
    values = node.args[3]
    here = indices.meta.get("placement", R)
    if not (isinstance(here, Shard) and _zeros(table)):
        return None
    wants = {table: R, mask: Shard(here.dim), indices: here, values: Shard(here.dim)}
    return [Candidate(tuple(wants[n] for n in tensor_inputs(node)), (P,))]


def slice_scatter(node: fx.Node, period: int) -> list[Candidate] | None:
    """Inductor's form of a slice's gradient (the slice written into zeros): split along another dimension it stays
    split; a partial sum written into zeros stays one."""
    base, source = tensor_inputs(node)[:2]
    dim = node.args[2] % len(shape_of(node)) if len(node.args) > 2 else 0
    here = source.meta.get("placement", R)
    if isinstance(here, Shard) and here.dim != dim:
        return [Candidate((here, here), (here,))]
    if here is P and _zeros(base):
        return [Candidate((R, P), (P,))]
    return None


def gather(node: fx.Node, period: int) -> list[Candidate] | None:
    """``gather`` along a whole dimension: split rows of the values and of the index give split rows
    (Inductor's form of the loss's pick of each target's log-probability)."""
    source, index = tensor_inputs(node)[:2]
    dim = node.args[1] % len(shape_of(source))
    split = next((p for p in (source.meta.get("placement"), index.meta.get("placement"))
                  if isinstance(p, Shard) and p.dim != dim), None)
    if split is None or shape_of(source)[split.dim] != shape_of(index)[split.dim]:
        return None
    return [Candidate((split, split), (split,))]


def nll_loss(node: fx.Node, period: int) -> list[Candidate]:
    """``nll_loss_forward`` summed over split rows: the sum and the count of valid targets are partial sums."""
    inputs = tensor_inputs(node)
    logits, target = inputs[:2]
    if node.args[3] == _REDUCTION_SUM and len(shape_of(logits)) == 2 and Shard(0) in (
            logits.meta.get("placement"), target.meta.get("placement")):
        return [Candidate((Shard(0), Shard(0), *(R for _ in inputs[2:])), (P, P))]
    return replicated(node, 0)


def nll_loss_backward(node: fx.Node, period: int) -> list[Candidate]:
    """Each split row's gradient needs only its own target and the whole count (a mean's divisor)."""
    inputs = tensor_inputs(node)  # grad_output, self, target, [weight], total_weight
    logits, target = inputs[1:3]
    if len(shape_of(logits)) == 2 and Shard(0) in (logits.meta.get("placement"), target.meta.get("placement")):
        ins = tuple(Shard(0) if n is logits or n is target else R for n in inputs)
        return [Candidate(ins, (Shard(0),))]
    return replicated(node, 0)


def sequence_split(node: fx.Node, period: int) -> list[Candidate]:
    dim = node.args[1]
    return [Candidate((Shard(dim),), (Shard(dim),))]


CONTEXT_RULES = {
    aten.view.default: view,
    aten._unsafe_view.default: view,
    aten.reshape.default: view,
    aten.unsqueeze.default: view,
    aten.squeeze.dim: view,
    aten.embedding.default: embedding,
    aten.embedding_dense_backward.default: embedding_backward,
    aten.nll_loss_forward.default: nll_loss,
    aten.nll_loss_backward.default: nll_loss_backward,
    aten._unsafe_masked_index_put_accumulate.default: masked_index_put,
    aten.gather.default: gather,
    aten.slice_scatter.default: slice_scatter,
    SEQUENCE_SPLIT: sequence_split,
}


# [Note: slicing before computing]
# Propagation runs forward: a value computed from whole inputs is whole, and a consumer that wants it
# split slices it. For what a model builds from positions alone (Hugging Face's causal mask, a
# (seq, seq) tensor made by comparing two aranges, then expanded and converted), that computes the
# whole mask on every rank and keeps 1/cp of it: seq x seq elements at the peak, the term that grows
# fastest with the sequence. So where a consumer wants a whole value split, and the op making it
# computes a split output from split inputs (elementwise, broadcast, a view, a cast), a copy of the op
# runs split on split inputs, recursively, and the whole one is dropped where nothing else reads it:
# the mask is built from this rank's query positions, a (seq / cp, seq) block.

_SLICED_ELEMENTWISE = POINTWISE | {aten._to_copy.default, aten.clone.default}
_SLICED_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                 aten.squeeze.dim}


def sliced_inputs(node: fx.Node, want: Shard, period: int) -> tuple[Placement, ...] | None:
    """The placements of ``node``'s tensor inputs from which it computes its output split as ``want``
    (None: it cannot, or it would not pay: an input is not a whole number of sequences long there)."""
    if node.op != "call_function" or isinstance(node.meta.get("val"), (tuple, list)):
        return None
    inputs = tensor_inputs(node)
    out_shape = shape_of(node)
    if node.target in _SLICED_ELEMENTWISE:
        wants = tuple(broadcast_placement(len(out_shape), shape_of(n), want) for n in inputs)
    elif node.target is aten.expand.default:
        before = shape_of(inputs[0])
        dim = want.dim - (len(out_shape) - len(before))
        wants = (Shard(dim) if dim >= 0 and before[dim] == out_shape[want.dim] else R,)
    elif node.target in _SLICED_VIEWS:
        before = shape_of(inputs[0])
        for gi, gj in view_groups(before, out_shape):
            if want.dim in gj:
                source = _innermost(gi, before)
                if _innermost(gj, out_shape) != want.dim or source is None:
                    return None
                wants = (Shard(source),)
                break
        else:
            return None
    else:
        return None
    whole = all(not isinstance(p, Shard) or shape_of(n)[p.dim] % period == 0 for n, p in zip(inputs, wants))
    return wants if whole and any(isinstance(p, Shard) for p in wants) else None


_MOVES = _SLICED_VIEWS | {aten.expand.default, aten.clone.default}


def repeats_a_split_value(node: fx.Node) -> bool:
    """Whether ``node`` only moves or repeats the data of a split value, through an ``expand`` that makes it
    larger: gathered whole, the value before the expand moves fewer bytes (grouped-query attention's keys and
    values, repeated per query head by Hugging Face's ``repeat_kv`` before attention gathers them)."""
    if node.op != "call_function" or node.target not in _MOVES:
        return False
    source = tensor_inputs(node)[0]
    if not isinstance(source.meta.get("placement"), Shard):
        return False
    if node.target is aten.expand.default and source.meta["val"].numel() < node.meta["val"].numel():
        return True
    return repeats_a_split_value(source)


def _whole_runs(node: fx.Node, candidate: Candidate, period: int) -> bool:
    """Every shard the candidate names is on a dimension of whole sequences, where the balanced layout is defined."""
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else (vals,)
    pairs: list[tuple[torch.Tensor, Placement | str | None]] = [
        (n.meta["val"], p) for n, p in zip(tensor_inputs(node), candidate.inputs)
    ] + [(v, p) for v, p in zip(vals, candidate.outputs) if isinstance(v, torch.Tensor)]
    return all(not isinstance(p, Shard) or (v.dim() > p.dim and v.shape[p.dim] % period == 0) for v, p in pairs)


def gathered_bytes(node: fx.Node) -> int:
    """The bytes an all-gather of ``node`` moves: those of the split value it repeats, where it does
    (``repeats_a_split_value``: gathered before the repeat), else its own."""
    while repeats_a_split_value(node):
        node = tensor_inputs(node)[0]
    return nbytes_of(node)


def context_candidates(node: fx.Node, size: int, period: int, exchange: str | None = None) -> list[Candidate]:
    """The candidates of ``node`` over a context-parallel axis of ``size`` ranks and sequences of ``period``;
    ``exchange`` fixes attention's (``core.plan.ATTENTION_EXCHANGES``; None: the cheaper, see [Note: two ways to exchange a sequence
    for attention])."""
    if node.target in ATTENTION | ATTENTION_BACKWARD:
        return attention(node, size, period, exchange)
    rule = CONTEXT_RULES.get(node.target)
    found = rule(node, period) if rule is not None else None
    found = candidates_for(node, size) if found is None else found
    kept = [c for c in found if _whole_runs(node, c, period)]
    return kept or replicated(node, size)

