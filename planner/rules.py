"""What each op may do on the tensor-parallel axis: its candidates, as data.

Placements of an activation on the tp axis: ``R`` (replicate), ``S`` (shard along the
feature / head dimension that a column Linear produces; views between ops keep it), ``P``
(partial sums, the output of a row Linear or a vocab-parallel embedding), ``Q`` (the token
stream split along the sequence: sequence parallel's norms and residuals, a layout's
``sequence_parallel`` only). Along the data
parallel axes every op is batch-sharded, so a candidate only describes the tp axis.

A candidate fixes the placement each input must arrive in, the placement of the gradient it
hands back for each input, its output's placement and the placement it needs its output's
gradient in (Megatron's f / g pair: a column Linear takes ``R`` and returns a ``P``
gradient, a row Linear returns ``P`` and wants an ``R`` gradient). Resharding between
producer and consumer is priced on the edges (``CONVERT``).

The type is the one ``Candidate`` of compiler/propagation/rules.py, and a Linear's and an
embedding's candidates are Megatron's layouts defined there (``COLUMN``, ``ROW``, ``VOCAB``)
in this vocabulary. What stays here only the planner knows: it prices a module-level forward
whose backward is never traced, so it names placements up to the dimension (``S`` follows
the split through views), says what gradients come back (f / g), and shards attention,
softmax, the loss, pointwise ops and RoPE's concatenation by kind rather than by the ATen op's rule.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from dpar.compiler.propagation.rules import COLUMN, ROW, VOCAB, Candidate
from dpar.planner.opgraph import Op

# Forward: what turning a producer's placement into a consumer's costs (None: free).
# P -> S all-reduces and slices: a row Linear's output is reduced whole, as Megatron's g does.
# Sequence parallel: P -> Q reduce-scatters the token stream, Q -> R gathers it before a column Linear; between a
# feature split and a token split (S <-> Q) the whole value is gathered and sliced; R -> Q only slices.
FORWARD_CONVERT = {
    ("S", "R"): "all_gather", ("P", "R"): "all_reduce", ("P", "S"): "all_reduce",
    ("P", "Q"): "reduce_scatter", ("Q", "R"): "all_gather", ("Q", "S"): "all_gather", ("S", "Q"): "all_gather",
}
# Backward: gradients arriving in one placement, wanted in another. P -> S is the
# reduce-scatter that autograd makes of a forward all-gather (and P -> Q sequence parallel's).
BACKWARD_CONVERT = {
    ("S", "R"): "all_gather", ("P", "R"): "all_reduce", ("P", "S"): "reduce_scatter",
    ("P", "Q"): "reduce_scatter", ("Q", "R"): "all_gather", ("Q", "S"): "all_gather", ("S", "Q"): "all_gather",
}
SEQUENCE_KINDS = ("norm", "pointwise", "other")  # token-wise ops sequence parallel may split

LOSS_STATS = 3  # vocab-parallel cross-entropy: row max, sum of exponentials, target logit
SOFTMAX_STATS = 2  # row max, sum of exponentials


def _candidate(
    name: str, inputs: tuple[str, ...], input_grads: tuple[str, ...], output: str, output_grad: str,
    params: tuple[str, ...], split: bool, stats: int = 0,
) -> Candidate:
    return Candidate(inputs, (output,), name, params, input_grads, (output_grad,), split, stats)


def _uniform(name: str, op: Op, placement: str, params: tuple[str, ...], split: bool, stats: int = 0) -> Candidate:
    n = len(op.inputs)
    return _candidate(name, (placement,) * n, (placement,) * n, placement, placement, params, split, stats)


def replicate(op: Op) -> Candidate:
    return _uniform("replicate", op, "R", ("R",) * len(op.params), split=False)


def _named(placement: Placement, activation: bool) -> str:
    """torch's placement in the planner's vocabulary: ``R``, ``P``, a parameter's ``S(dim)``, an activation's ``S``."""
    if isinstance(placement, Shard):
        return "S" if activation else f"S({placement.dim})"
    return "P" if placement.is_partial() else "R"


# Megatron's f / g, which only the planner prices (propagation places the traced backward's
# ops like any other): the gradient handed back to each input, the placement the output's
# gradient must arrive in. A column Linear's replicated input gets a partial sum back; a row
# Linear's partial-sum output wants its gradient whole; an embedding's indices get none.
_GRADIENTS = {"column": (("P",), "S"), "row": (("S",), "R"), "vocab": (("R",), "R")}


def _megatron(layout: Candidate, op: Op) -> Candidate:
    """One of Megatron's layouts (``rules.COLUMN``, ``ROW``, ``VOCAB``) for ``op``, in the planner's vocabulary."""
    input_grads, output_grad = _GRADIENTS[layout.name]
    return _candidate(
        layout.name, tuple(_named(p, True) for p in layout.inputs), input_grads, _named(layout.output, True),
        output_grad, tuple(_named(p, False) for p in layout.params[: len(op.params)]), layout.split,
    )


def _linear(op: Op, tp: int) -> list[Candidate]:
    out_features, in_features = op.param_shapes[0]
    found = []
    if out_features % tp == 0:
        found.append(_megatron(COLUMN, op))
    if in_features % tp == 0:
        found.append(_megatron(ROW, op))
    return found


def _embedding(op: Op, tp: int) -> list[Candidate]:
    if op.param_shapes[0][0] % tp:
        return []
    return [_megatron(VOCAB, op)]


def _attention(op: Op, tp: int) -> list[Candidate]:
    heads = [shape[-3] for shape in op.input_shapes[:3] if len(shape) >= 3]
    if len(heads) < 3 or any(h % tp for h in heads):
        return []
    rest = ("R",) * (len(op.inputs) - 3)  # an attention mask broadcasts over heads
    return [_candidate("shard", ("S",) * 3 + rest, ("S",) * 3 + rest, "S", "S", (), True)]


def _softmax_or_loss(op: Op, tp: int) -> list[Candidate]:
    if op.input_shapes[0][-1] % tp:
        return []
    if op.kind == "softmax":
        return [_uniform("shard", op, "S", (), True, SOFTMAX_STATS)]
    rest = ("R",) * (len(op.inputs) - 1)  # the targets
    return [_candidate("shard", ("S",) + rest, ("S",) + rest, "R", "R", (), True, LOSS_STATS)]


def _pointwise(op: Op, tp: int) -> list[Candidate]:
    last = op.output_shape[-1] if op.output_shape else 0
    if not last or last % tp or any(s[-1:] != (last,) for s in op.input_shapes):
        return []
    if op.params:  # a per-feature scale (a norm's weight) is read whole: the runtime's propagation keeps it so
        return []
    return [_uniform("shard", op, "S", (), True)]


def _concat(op: Op, tp: int) -> list[Candidate]:
    """A concatenation along the last dimension of per-head values (``capture._along_last``): each rank joins its
    own heads' halves, as attention reads them split."""
    if any(len(s) < 4 or s[-3] % tp for s in op.input_shapes):
        return []
    return [_uniform("shard", op, "S", (), True)]


def _matmul(op: Op, tp: int) -> list[Candidate]:
    """Activation @ activation with batch dimensions (attention written by hand): heads shard."""
    if len(op.input_shapes) != 2 or any(len(s) < 3 or s[-3] % tp for s in op.input_shapes):
        return []
    return [_uniform("shard", op, "S", (), True)]


def _sequence(op: Op, tp: int) -> list[Candidate]:
    """Sequence parallel: a token-wise op over (batch, sequence, features) or (tokens, features) on 1/tp of the
    tokens, reading its weights (a norm's scale) whole; inputs over the same tokens (any last dim: a row reduction's,
    a broadcast scale's) arrive split too, others whole."""
    shape = op.output_shape
    if op.kind not in SEQUENCE_KINDS or not op.batched or len(shape) not in (2, 3) or shape[-2] % tp:
        return []
    inputs = tuple("Q" if b and s[:-1] == shape[:-1] else "R" for s, b in zip(op.input_shapes, op.input_batched))
    if "Q" not in inputs:
        return []
    return [_candidate("sequence", inputs, inputs, "Q", "Q", ("R",) * len(op.params), True)]


SHARDED = {
    "linear": _linear,
    "embedding": _embedding,
    "attention": _attention,
    "softmax": _softmax_or_loss,
    "loss": _softmax_or_loss,
    "pointwise": _pointwise,
    "concat": _concat,
    "matmul": _matmul,
}


def candidates(op: Op, tp: int, sequence_parallel: bool = False) -> tuple[Candidate, ...]:
    """``replicate`` first, then whatever ``tp`` divides (last, under ``sequence_parallel``, the token split); only
    ``replicate`` without a tp axis."""
    rule = SHARDED.get(op.kind)
    if tp == 1:
        return (replicate(op),)
    found = (replicate(op), *(rule(op, tp) if rule is not None else ()))
    return (*found, *_sequence(op, tp)) if sequence_parallel else found
