"""Sharding rules: for each ATen op, the placements its inputs may have and what its outputs then are.

Placements are torch's own (``Replicate``, ``Shard(dim)``, ``Partial``), over
one mesh dimension. A rule lists *candidates*; propagation picks the one whose
inputs are cheapest to reach from where the values are. Every candidate is
exact: a shard stays a shard only where the op treats that dimension
independently (a batch or head dimension, a matmul's free dimension); a
contraction over a sharded dimension gives a partial sum; anything nonlinear
in a partial sum needs it reduced first. An op without a rule runs replicated,
which is always right and only costs communication.

[Note: one rule table]
This module is where tensor parallel's knowledge of ops lives once: ``Candidate`` (the one
type for "an op may run with its inputs and outputs placed so"), the op families
(``MATMUL``, ``EMBEDDING``, ``SOFTMAX``, ``ATTENTION``, ``LAYER_NORM``) that key both
``RULES`` and the planner's op kinds (planner/capture.py), and Megatron-LM's layouts of the
layers it splits (``COLUMN``, ``ROW``, ``VOCAB``), from which ``megatron.py``'s plan and the
planner's linear and embedding candidates (planner/rules.py) are made. What stays elsewhere
is knowledge only one of them needs: ``megatron.py`` follows a split through the eager
forward's torch functions (before any trace exists, to choose the plan); the planner prices
gradients' placements (Megatron's f / g), per-row statistics and compute on a module-level
forward whose backward is never traced.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

import dpar.runtime.expert_parallel  # noqa: F401  (registers the experts' marker ops)
from dpar.core.facts import can_split
from dpar.core.torch_internals import C10D_FUNCTIONAL

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL
R, P = Replicate(), Partial()


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way an op may run over the tp mesh dimension: the placement each tensor input must
    arrive in (in ``tensor_inputs`` order) and each output leaves in.

    Propagation fills ``inputs`` and ``outputs`` only, with torch's placements; parameters are
    inputs like any other, and gradients are ops of the traced backward with rules of their own.
    The planner's candidates (planner/rules.py, in its abstract ``R`` / ``S`` / ``P``) price a
    forward whose backward is never traced, so they also carry the rest, which only it reads.
    """

    inputs: tuple[Placement | str, ...]
    outputs: tuple[Placement | str | None, ...]  # one per output; a single-tensor op has one
    name: str = ""  # the planner's and Megatron's: replicate, column, row, vocab, shard
    params: tuple[Placement | str, ...] = ()  # each parameter the layer reads, in argument order
    input_grads: tuple[str, ...] = ()  # the planner's: placement of the gradient handed back to each input
    output_grads: tuple[str, ...] = ()  # the planner's: placement each output's gradient must arrive in
    split: bool = False  # the planner's: compute (and the sharded tensors) divided by the tp degree
    stats: int = 0  # the planner's: fp32 all-reduces of one value per row (vocab-parallel softmax / loss)
    inner: float = 0.0  # propagation's: bytes-equivalent cost of the collectives the op itself then runs (cp's attention)

    @property
    def output(self) -> Placement | str | None:
        return self.outputs[0]

    @property
    def output_grad(self) -> str:
        return self.output_grads[0]

    @property
    def splits_a_parameter(self) -> bool:
        """What makes a tp axis tensor parallel: see [Note: a tp axis must split a parameter] in planner/solver.py."""
        return any(p not in ("R", R) for p in self.params)


# --- op families: the ATen ops of the traced graphs, keyed alike by RULES and the planner's kinds ---

MATMUL = {aten.mm.default, aten.bmm.default}
EMBEDDING = {aten.embedding.default}
# _safe_softmax: SDPA's math path under an explicit mask (a model captured on meta gets one from HF).
SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default}
LAYER_NORM = {aten.native_layer_norm.default}
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}
# Their backward ops, which only propagation sees (the planner traces no backward).
SOFTMAX_BACKWARD = {aten._softmax_backward_data.default, aten._log_softmax_backward_data.default}
LAYER_NORM_BACKWARD = {aten.native_layer_norm_backward.default}
ATTENTION_BACKWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
}


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]


def shape_of(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _outputs(node: fx.Node, placement: Placement) -> tuple[Placement | None, ...]:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(placement if isinstance(v, torch.Tensor) else None for v in val)
    return (placement,)


def replicated(node: fx.Node, tp: int) -> list[Candidate]:
    """The rule of last resort: everything replicated."""
    return [Candidate(tuple(R for _ in tensor_inputs(node)), _outputs(node, R))]


def _even(size: int, tp: int) -> bool:
    return size % tp == 0 and size >= tp


# --- elementwise -------------------------------------------------------------------------------

# Partial sums pass through these unchanged (they are linear in every tensor input) ...
_LINEAR = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.clone.default, aten.detach.default,
           aten.alias.default, aten._to_copy.default, aten._conj.default, aten.conj_physical.default,
           aten.resolve_conj.default}
# ... and through these when only one input is partial (scaling by a replicated factor).
_SCALING = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}

POINTWISE = _LINEAR | _SCALING | {
    aten.gelu.default, aten.gelu_backward.default, aten.relu.default, aten.threshold_backward.default,
    aten.tanh.default, aten.tanh_backward.default, aten.sigmoid.default, aten.sigmoid_backward.default,
    aten.silu.default, aten.silu_backward.default, aten.exp.default, aten.log.default, aten.rsqrt.default,
    aten.pow.Tensor_Scalar, aten.sqrt.default, aten.where.self, aten.masked_fill.Scalar,
    aten.add.Scalar, aten.sub.Scalar, aten.le.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.gt.Scalar,
    aten.eq.Scalar, aten.ne.Scalar, aten.ge.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.lt.Tensor, aten.eq.Tensor,
    aten.ne.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_and.default,
    aten.logical_or.default, aten.where.Scalar, aten.where.ScalarOther, aten.where.ScalarSelf, aten.logical_not.default, aten.copy.default, aten.lift_fresh_copy.default,
}


def broadcast_placement(out_ndim: int, in_shape: Sequence[int], placement: Placement) -> Placement:
    """What an input broadcast into an output sharded as ``placement`` must be."""
    if not isinstance(placement, Shard):
        return placement
    dim = placement.dim - (out_ndim - len(in_shape))
    if dim < 0 or in_shape[dim] == 1:
        return R  # broadcast along the sharded dimension: every rank needs all of it
    return Shard(dim)


def pointwise(node: fx.Node, tp: int) -> list[Candidate]:
    """Any operand's shard (in output coordinates); a partial sum through a linear op; replicated.

    Operands broadcast along the sharded dimension (an attention mask's size-1
    head dimension, RoPE's cos/sin) stay whole on every rank. A partial sum
    scaled by another operand needs that operand replicated: a partial sum times
    a block is neither.
    """
    inputs = tensor_inputs(node)
    out_shape = shape_of(node)
    here = [n.meta.get("placement", R) for n in inputs]
    options: list[Placement] = []
    for value, placement in zip(inputs, here):
        if isinstance(placement, Shard):
            out = Shard(placement.dim + len(out_shape) - len(shape_of(value)))
            if out not in options and can_split(out_shape[out.dim], tp):
                options.append(out)
    if P in here:
        partial = [p is P for p in here]
        if node.target in _LINEAR and all(partial):
            options.append(P)
        elif node.target in _SCALING and sum(partial) == 1 and (partial[0] or node.target is aten.mul.Tensor):
            options.append(P)
    options.append(R)
    candidates = []
    for out in options:
        if out is P:
            ins = tuple(P if p is P else R for p in here)
        else:
            ins = tuple(broadcast_placement(len(out_shape), shape_of(n), out) for n in inputs)
        candidates.append(Candidate(ins, _outputs(node, out)))
    return candidates


# --- matmul ------------------------------------------------------------------------------------


def cast(node: fx.Node, tp: int) -> list[Candidate]:
    """A partial sum is reduced before a cast to a narrower dtype, as one device rounds the whole sum once
    (HF Llama's norms and torchtitan's RoPE compute in float32 inside a float64 model, and their backward casts
    the gradient, a partial sum over the column-parallel Linears, down). Otherwise a pointwise op."""
    source = tensor_inputs(node)[0]
    dtype = node.kwargs.get("dtype")
    wide = source.meta["val"].dtype
    if source.meta.get("placement") is P and dtype is not None and dtype.is_floating_point and wide.is_floating_point and (
            torch.finfo(dtype).bits < torch.finfo(wide).bits):
        return [Candidate((R,), (R,))]
    return pointwise(node, tp)


def matmul(node: fx.Node, tp: int) -> list[Candidate]:
    """mm / bmm: shard a free dimension, or contract a sharded one into a partial sum."""
    a, b = (shape_of(n) for n in tensor_inputs(node))
    batch = len(a) - 2  # 0 for mm, 1 for bmm
    m, k, n = batch, batch + 1, batch + 1
    candidates = [Candidate((R, R), (R,))]
    if can_split(a[m], tp):
        candidates.append(Candidate((Shard(m), R), (Shard(m),)))
    if can_split(b[-1], tp):
        candidates.append(Candidate((R, Shard(n)), (Shard(len(a) - 1),)))
    if can_split(a[k], tp):
        candidates.append(Candidate((Shard(k), Shard(batch)), (P,)))
    if batch and can_split(a[0], tp):
        candidates.append(Candidate((Shard(0), Shard(0)), (Shard(0),)))
    candidates += [Candidate((P, R), (P,)), Candidate((R, P), (P,))]
    return candidates


# --- dimension shuffles and views --------------------------------------------------------------


def _permuted(node: fx.Node, order: Sequence[int]) -> list[Candidate]:
    """Output dim ``i`` is input dim ``order[i]``."""
    here = tensor_inputs(node)[0].meta.get("placement", R)
    if isinstance(here, Shard):
        return [Candidate((here,), (Shard(list(order).index(here.dim)),))]
    return [Candidate((here,), (here,))]


TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}


def transpose_order(node: fx.Node) -> list[int]:
    """For t / transpose / permute: output dim ``i`` is input dim ``order[i]``."""
    ndim = len(shape_of(node))
    order = list(range(ndim))
    if node.target is aten.t.default:
        order = order[::-1]
    elif node.target is aten.permute.default:
        order = [d % ndim for d in node.args[1]]
    else:
        d0, d1 = (d % ndim for d in node.args[1:3])
        order[d0], order[d1] = d1, d0
    return order


def transpose(node: fx.Node, tp: int) -> list[Candidate]:
    return _permuted(node, transpose_order(node))


def view_groups(before: Sequence[int], after: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dimensions whose products match: ``(B, T, C) -> (B*T, C)`` gives
    ``[([0, 1], [0]), ([2], [1])]``. Size-1 dimensions join the run next to them."""
    groups, i, j = [], 0, 0
    while i < len(before) or j < len(after):
        gi, gj = [i] if i < len(before) else [], [j] if j < len(after) else []
        pi = before[i] if i < len(before) else 1
        pj = after[j] if j < len(after) else 1
        i, j = i + bool(gi), j + bool(gj)
        while pi != pj or (i < len(before) and before[i] == 1) or (j < len(after) and after[j] == 1):
            if i < len(before) and before[i] == 1:  # (heads, d) -> (heads, 1, d): the 1 joins heads' run, not d's
                gi.append(i)
                i += 1
            elif j < len(after) and after[j] == 1:
                gj.append(j)
                j += 1
            elif (pi <= pj and i < len(before)) or j >= len(after):
                pi *= before[i]
                gi.append(i)
                i += 1
            else:
                pj *= after[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    return groups


def view_dim(before: Sequence[int], after: Sequence[int], dim: int, tp: int) -> int | None:
    """Where a shard along ``before[dim]`` lands after the view, or None if it cannot stay a shard.

    It stays a shard when it is the outermost non-trivial dimension of its run
    and both it and the outermost non-trivial dimension of the matching run are
    multiples of the degree: splitting ``C`` into ``(heads, head_dim)`` shards the
    heads. An uneven shard (a vocabulary of 50257) stays one only where that
    dimension keeps its size, since its blocks need not line up with any other.
    """
    for gi, gj in view_groups(before, after):
        if dim in gi:
            outer_in = next((d for d in gi if before[d] != 1), None)
            outer_out = next((d for d in gj if after[d] != 1), None)
            if outer_in != dim or outer_out is None:
                return None
            even = _even(before[dim], tp) and _even(after[outer_out], tp)
            return outer_out if even or before[dim] == after[outer_out] else None
    return None


def _carried(here: Placement, dim: int | None) -> list[Candidate]:
    """A one-input op that takes a shard along ``here.dim`` to one along ``dim`` (None: it cannot,
    the input is gathered); anything else passes through unchanged."""
    if not isinstance(here, Shard):
        return [Candidate((here,), (here,))]
    if dim is None:
        return [Candidate((R,), (R,))]
    return [Candidate((here,), (Shard(dim),)), Candidate((R,), (R,))]


def view(node: fx.Node, tp: int) -> list[Candidate]:
    source = tensor_inputs(node)[0]
    here = source.meta.get("placement", R)
    dim = view_dim(shape_of(source), shape_of(node), here.dim, tp) if isinstance(here, Shard) else None
    return _carried(here, dim)


def complex_view(node: fx.Node, tp: int) -> list[Candidate]:
    """``view_as_complex`` folds the last dimension (real, imaginary) into the dtype, ``view_as_real``
    unfolds it: every other dimension keeps its shard (torchtitan's RoPE rotates each head's pairs
    in place, so its heads stay split), and a partial sum stays one (both are linear)."""
    source = tensor_inputs(node)[0]
    here = source.meta.get("placement", R)
    last = len(shape_of(source)) - 1
    if isinstance(here, Shard) and node.target is aten.view_as_complex.default and here.dim == last:
        return [Candidate((R,), (R,))]
    return _carried(here, here.dim if isinstance(here, Shard) else None)


def expand(node: fx.Node, tp: int) -> list[Candidate]:
    """Broadcasting keeps a shard along a dimension whose size it does not change."""
    source = tensor_inputs(node)[0]
    here = source.meta.get("placement", R)
    before, after = shape_of(source), shape_of(node)
    dim = None
    if isinstance(here, Shard) and before[here.dim] == after[here.dim + len(after) - len(before)]:
        dim = here.dim + len(after) - len(before)
    return _carried(here, dim)


def argument(node: fx.Node, names: Sequence[str]) -> object:
    """The value passed for the first of ``names`` in the op's schema (positional, keyword or default)."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name in names:
            if index < len(node.args):
                return node.args[index]
            return node.kwargs.get(argument.name, argument.default_value)
    return None


def _dim_argument(node: fx.Node, ndim: int) -> int:
    return argument(node, ("dim",)) % ndim


def along(node: fx.Node, tp: int) -> list[Candidate]:
    """slice, its backward, split: cutting along one dimension keeps a shard along any other
    (every rank cuts its block the same way) and a partial sum (cutting is linear)."""
    source = tensor_inputs(node)[0]
    here = source.meta.get("placement", R)
    dim = _dim_argument(node, len(shape_of(source)))
    if not isinstance(here, Shard):
        return [Candidate((here,), _outputs(node, here))]
    if here.dim == dim:
        return [Candidate((R,), _outputs(node, R))]
    return [Candidate((here,), _outputs(node, here)), Candidate((R,), _outputs(node, R))]


def select(node: fx.Node, tp: int) -> list[Candidate]:
    """Picking one index along a dimension keeps a shard along any other (one dimension fewer before it)
    and a partial sum (picking is linear)."""
    here = tensor_inputs(node)[0].meta.get("placement", R)
    dim = _dim_argument(node, len(shape_of(tensor_inputs(node)[0])))
    if not isinstance(here, Shard):
        return [Candidate((here,), (here,))]
    if here.dim == dim:
        return [Candidate((R,), (R,))]
    return [Candidate((here,), (Shard(here.dim - (here.dim > dim)),)), Candidate((R,), (R,))]


def select_backward(node: fx.Node, tp: int) -> list[Candidate]:
    """``select``'s gradient, zeros but at the picked index: a shard of the gradient is one of the result along
    the same dimension (one further after the picked one); a partial sum stays one."""
    here = tensor_inputs(node)[0].meta.get("placement", R)
    dim = _dim_argument(node, len(shape_of(node)))
    if not isinstance(here, Shard):
        return [Candidate((here,), (here,))]
    return [Candidate((here,), (Shard(here.dim + (here.dim >= dim)),)), Candidate((R,), (R,))]


def cat(node: fx.Node, tp: int) -> list[Candidate]:
    """Joining along one dimension keeps a shard along another when every piece is split alike
    (RoPE's rotate_half joins two halves of each head); partial sums join into one. An empty
    1-D piece (a cache's first step), which cat skips, stays replicated."""
    inputs = tensor_inputs(node)
    dim = _dim_argument(node, len(shape_of(node)))
    here = [n.meta.get("placement", R) for n in inputs]
    pieces = [shape_of(n) != (0,) for n in inputs]
    candidates = []
    shard = next((p for p in here if isinstance(p, Shard) and p.dim != dim), None)
    if shard is not None and all(len(shape_of(n)) == len(shape_of(node)) for n, piece in zip(inputs, pieces) if piece):
        candidates.append(Candidate(tuple(shard if piece else R for piece in pieces), (shard,)))
    if all(p is P for p, piece in zip(here, pieces) if piece):
        candidates.append(Candidate(tuple(P if piece else R for piece in pieces), (P,)))
    return candidates + replicated(node, tp)


# --- reductions, normalisation, attention, embedding -------------------------------------------


def reduction(node: fx.Node, tp: int) -> list[Candidate]:
    """sum over a sharded dim gives a partial sum; mean there would need rescaling, so it gathers."""
    source = tensor_inputs(node)[0]
    here = source.meta.get("placement", R)
    ndim = len(shape_of(source))
    dims = [d % ndim for d in node.args[1]] if len(node.args) > 1 and node.args[1] else list(range(ndim))
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    if here is P and node.target in (aten.sum.dim_IntList, aten.sum.default):
        return [Candidate((P,), (P,))]
    if isinstance(here, Shard):
        if here.dim in dims:
            if node.target in (aten.sum.dim_IntList, aten.sum.default):
                return [Candidate((here,), (P,)), Candidate((R,), (R,))]
        else:
            out = here.dim if keepdim else here.dim - sum(d < here.dim for d in dims)
            return [Candidate((here,), (Shard(out),)), Candidate((R,), (R,))]
    return [Candidate((R,), (R,))]


def softmax(node: fx.Node, tp: int) -> list[Candidate]:
    """Softmax and its backward: shards along any dimension but the normalised one; a log-softmax (a loss's) also
    along the normalised one, with its statistics reduced over the group (``vocabulary_loss.py``)."""
    inputs = tensor_inputs(node)
    ndim = len(shape_of(inputs[0]))
    dim = [a for a in node.args if isinstance(a, int) and not isinstance(a, bool)][0] % ndim
    here = inputs[0].meta.get("placement", R)
    candidates = []
    if isinstance(here, Shard) and here.dim != dim:
        candidates.append(Candidate(tuple(here for _ in inputs), (here,)))
    elif here == Shard(dim) and node.target in LOG_SOFTMAX:
        rows = math.prod(shape_of(inputs[0])) // shape_of(inputs[0])[dim]
        statistics = 4 * rows * (2 if node.target is aten._log_softmax.default else 1)  # max and sum; the sum back
        candidates.append(Candidate(tuple(here for _ in inputs), (here,), name="vocab", inner=2 * (tp - 1) / tp * statistics))
    return candidates + [Candidate(tuple(R for _ in inputs), (R,))]


LOG_SOFTMAX = {aten._log_softmax.default, aten._log_softmax_backward_data.default}
NLL_LOSS = {aten.nll_loss_forward.default, aten.nll_loss_backward.default}


def nll_loss(node: fx.Node, tp: int) -> list[Candidate]:
    """The negative log-likelihood of (rows, classes) log-probabilities split by class: each rank picks the targets
    in its block (a partial sum of the loss); the count of targets is the whole batch's. Unweighted only."""
    forward = node.target is aten.nll_loss_forward.default
    scores = node.args[0 if forward else 1]
    weight = node.args[2 if forward else 3]
    inputs = tensor_inputs(node)
    if weight is None and len(shape_of(scores)) == 2 and scores.meta.get("placement") == Shard(1):
        ins = tuple(Shard(1) if value is scores else R for value in inputs)
        outs = (P, R) if forward else (Shard(1),)
        return [Candidate(ins, outs, name="vocab"), Candidate(tuple(R for _ in inputs), _outputs(node, R))]
    return replicated(node, tp)


def layer_norm(node: fx.Node, tp: int) -> list[Candidate]:
    """Shards along batch-like dims; the normalised dims must be whole on each rank.

    The shard comes from any full-rank input: in the backward the incoming
    gradient may be a partial sum while the saved input is sharded (sequence
    parallel), and then the gradient is reduce-scattered to match. The weight
    and bias gradients sum over batch-like dims, so a shard there makes them partial.
    """
    inputs = tensor_inputs(node)
    ndim = len(shape_of(inputs[0]))
    leading = ndim - len(node.args[2] if node.target is aten.native_layer_norm_backward.default else node.args[1])
    sharded = [
        n.meta.get("placement") for n in inputs
        if len(shape_of(n)) == ndim and isinstance(n.meta.get("placement"), Shard)
    ]
    here = next((p for p in sharded if p.dim < leading), R)
    candidates = []
    if isinstance(here, Shard):
        ins = tuple(here if len(shape_of(n)) == ndim else R for n in inputs)
        if node.target is aten.native_layer_norm.default:
            candidates.append(Candidate(ins, (here, here, here)))
        else:
            candidates.append(Candidate(ins, (here, P, P)))
    return candidates + replicated(node, tp)


MASK_ARGUMENTS = ("attn_mask", "attn_bias")
# Backward ops that also return the mask's gradient (by output index): where the mask is
# broadcast over the split heads that gradient is a sum over every rank's heads, so they run whole.
_MASK_GRADIENT = {aten._scaled_dot_product_efficient_attention_backward.default: 3}


def attention(node: fx.Node, tp: int) -> list[Candidate]:
    """Scaled dot-product attention and its backward: independent per batch (dim 0) and per head (dim 1).

    Every tensor of three or more dims (q, k, v, the output, its gradient, the
    log-sum-exp) has batch and heads first and is split alike; the mask
    broadcasts into (batch, heads, q, k) from the right, so a mask with one head
    (a padding mask) or none (RoPE-free causal bias) is whole on every rank.
    Seeds, offsets and sequence lengths (under three dims) are replicated.
    """
    inputs = tensor_inputs(node)
    mask = argument(node, MASK_ARGUMENTS)
    mask = mask if isinstance(mask, fx.Node) else None
    per_head = [n for n in inputs if n is not mask and len(shape_of(n)) >= 3]
    sharded = [n.meta.get("placement") for n in per_head if isinstance(n.meta.get("placement"), Shard)]
    here = next((p for p in sharded if p.dim in (0, 1)), None)
    if here is None or not all(can_split(shape_of(n)[here.dim], tp) for n in per_head):
        return replicated(node, tp)
    ins = tuple(
        broadcast_placement(4, shape_of(n), here) if n is mask else here if n in per_head else R for n in inputs
    )
    vals = node.meta["val"]
    outs = tuple(
        (here if v.dim() >= 3 else R) if isinstance(v, torch.Tensor) else None
        for v in (vals if isinstance(vals, (tuple, list)) else (vals,))
    )
    gradient = _MASK_GRADIENT.get(node.target)
    if mask is not None and ins[inputs.index(mask)] == R and gradient is not None and outs[gradient] is not None:
        return replicated(node, tp)
    return [Candidate(ins, outs)] + replicated(node, tp)


def embedding(node: fx.Node, tp: int) -> list[Candidate]:
    """A vocabulary-split table gives a partial sum (each rank looks up its own rows, zeros elsewhere);
    a column-split table gives output sharded on the last dim."""
    weight, indices = tensor_inputs(node)[:2]
    here = weight.meta.get("placement", R)
    out_ndim = len(shape_of(node))
    if here == Shard(0):
        return [Candidate((Shard(0), R), (P,))]
    if here == Shard(1):
        return [Candidate((Shard(1), R), (Shard(out_ndim - 1),))]
    return [Candidate((R, R), (R,))]


def embedding_backward(node: fx.Node, tp: int) -> list[Candidate]:
    """``embedding_dense_backward``: this rank's rows of the gradient table where the forward
    looked up a vocabulary-split table with the same indices, else the whole table."""
    indices = node.args[1]
    split = any(
        u.target is aten.embedding.default and u.meta.get("placement_inputs", (R,))[0] == Shard(0)
        for u in indices.users
    )
    whole, rows = Candidate((R, R), (R,)), Candidate((R, R), (Shard(0),))
    return [rows, whole] if split else [whole, rows]


def sequence_shard(node: fx.Node, tp: int) -> list[Candidate]:
    """Sequence parallel (Megatron-SP): a partial sum entering a pointwise op of the token
    stream (``(..., seq, hidden)``) is reduce-scattered along the sequence instead of all-reduced.

    Offered in addition to the op's own rule. The same bytes then come back as an
    all-gather before the next layer that needs whole sequences (a matmul over
    flattened tokens), so communication is unchanged while norms, dropout and the
    residual stream between them run on, and keep, 1/tp of the tokens.
    """
    if node.target not in POINTWISE:
        return []
    inputs = tensor_inputs(node)
    shape = shape_of(node)
    if len(shape) < 3 or not can_split(shape[-2], tp) or all(n.meta.get("placement", R) != P for n in inputs):
        return []
    out = Shard(len(shape) - 2)
    return [Candidate(tuple(broadcast_placement(len(shape), shape_of(n), out) for n in inputs), _outputs(node, out))]


def keep_input(node: fx.Node, tp: int) -> list[Candidate]:
    """Collectives over another mesh dimension (fsdp's) and their waits: local data stays local."""
    here = tensor_inputs(node)[0].meta.get("placement", R)
    return [Candidate((here,) + tuple(R for _ in tensor_inputs(node)[1:]), _outputs(node, here))]


def along_other_group(node: fx.Node, tp: int) -> list[Candidate]:
    """An fsdp all-gather or reduce-scatter (over the dp mesh dimension, along dim 0): a block
    along any other dim, or a partial sum (both collectives are linear), stays as it is.

    [Note: a tp block on the dp collective's dim]
    A value split over tp along dim 0 cannot go through a dp collective along dim 0
    as a block: dp rank d's share of a reduce-scatter is rows [d*n/dp, (d+1)*n/dp)
    of the whole, while tp rank t holds rows [t*n/tp, (t+1)*n/tp). Scattering the
    tp block over dp hands rank (d, t) a slice of t's block, and gathering those
    over tp afterwards interleaves them: a wrong order, silently (a norm weight,
    replicated over tp and sharded over dp, whose gradient the backward computes
    as hidden-dim blocks: torchtitan's Llama 3 under fsdp+tp was 0.045 off torch
    DDP after one SGD step). Such a value is gathered over tp first.
    """
    here = tensor_inputs(node)[0].meta.get("placement", R)
    if isinstance(here, Shard) and here.dim == 0:
        here = R
    return [Candidate((here,) + tuple(R for _ in tensor_inputs(node)[1:]), _outputs(node, here))]


EXPERTS_PARTIAL = torch.ops.dpar.experts_partial.default
EXPERTS_INPUT = torch.ops.dpar.experts_input.default


def experts_partial(node: fx.Node, tp: int) -> list[Candidate]:
    """This rank's experts' share of a layer's output (or of its inputs' gradient): a partial sum over the group
    (see [Note: experts spread over a tensor-parallel group] in runtime/expert_parallel.py)."""
    return [Candidate((R,), (P,))]


def getitem(node: fx.Node, tp: int) -> list[Candidate]:
    source, index = node.args
    return [Candidate((), (source.meta.get("placement_outputs", (R,))[index] or R,))]


Rule = Callable[[fx.Node, int], list[Candidate]]

RULES: dict[object, Rule] = {
    **{op: pointwise for op in POINTWISE},
    aten._to_copy.default: cast,
    **dict.fromkeys(MATMUL, matmul),
    aten.t.default: transpose,
    aten.transpose.int: transpose,
    aten.permute.default: transpose,
    aten.view.default: view,
    aten._unsafe_view.default: view,
    aten.reshape.default: view,
    aten.expand.default: expand,
    aten.view_as_complex.default: complex_view,
    aten.view_as_real.default: complex_view,
    aten.slice.Tensor: along,
    aten.slice_backward.default: along,
    aten.split.Tensor: along,
    aten.split_with_sizes.default: along,
    aten.cat.default: cat,
    aten.select.int: select,
    aten.select_backward.default: select_backward,
    aten.unsqueeze.default: view,  # inserting or dropping a size-1 dimension is a view
    aten.squeeze.dim: view,
    aten.sum.dim_IntList: reduction,
    aten.sum.default: reduction,
    aten.mean.dim: reduction,
    aten.amax.default: reduction,
    **dict.fromkeys(SOFTMAX | SOFTMAX_BACKWARD, softmax),
    **dict.fromkeys(NLL_LOSS, nll_loss),
    **dict.fromkeys(LAYER_NORM | LAYER_NORM_BACKWARD, layer_norm),
    **dict.fromkeys(ATTENTION | ATTENTION_BACKWARD, attention),
    **dict.fromkeys(EMBEDDING, embedding),
    aten.embedding_dense_backward.default: embedding_backward,
    operator.getitem: getitem,
    EXPERTS_PARTIAL: experts_partial,
    c10d.all_gather_into_tensor.default: along_other_group,
    c10d.reduce_scatter_tensor.default: along_other_group,
    c10d.all_reduce.default: keep_input,
    c10d.wait_tensor.default: keep_input,
}


def candidates_for(node: fx.Node, tp: int) -> list[Candidate]:
    rule = RULES.get(node.target, replicated)
    return rule(node, tp)


# --- Megatron-LM's layers ----------------------------------------------------------------------

# [Note: Megatron's layouts]
# The layers tensor parallel splits, in a Linear's own orientation (weight (out, in)): a
# *column* Linear splits its output features (weight and bias by rows) and hands on its
# output split along the last dim; a *row* Linear reads an input split along the last dim
# (the units it contracts), splits its weight by columns and keeps its bias whole, giving a
# partial sum; a *vocabulary-parallel* embedding splits its table by rows and gives a partial
# sum (each rank's lookup is zero outside its rows). ``matmul`` and ``embedding`` above place
# the same at ATen level whatever the plan; these say which layers the plan splits how:
# ``megatron.py`` chooses column or row per Linear with them, the planner's linear and
# embedding candidates are them in its own vocabulary.
COLUMN = Candidate((R,), (Shard(-1),), name="column", params=(Shard(0), Shard(0)), split=True)
ROW = Candidate((Shard(-1),), (P,), name="row", params=(Shard(1), R), split=True)
VOCAB = Candidate((R,), (P,), name="vocab", params=(Shard(0),), split=True)
