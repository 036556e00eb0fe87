"""What each op may do on the tensor-parallel axis: its candidates, as data.

Placements of an activation on the tp axis: ``R`` (replicate), ``S`` (shard along the
feature / head dimension that a column Linear produces; views between ops keep it), ``P``
(partial sums, the output of a row Linear or a vocab-parallel embedding). Along the data
parallel axes every op is batch-sharded, so a candidate only describes the tp axis.

A candidate fixes the placement each input must arrive in, the placement of the gradient it
hands back for each input, its output's placement and the placement it needs its output's
gradient in (Megatron's f / g pair: a column Linear takes ``R`` and returns a ``P``
gradient, a row Linear returns ``P`` and wants an ``R`` gradient). Resharding between
producer and consumer is priced on the edges (``CONVERT``).
"""

from __future__ import annotations

import dataclasses

from dpar.planner.opgraph import Op


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str  # replicate, column, row, vocab, shard
    inputs: tuple[str, ...]  # required placement of each activation input
    input_grads: tuple[str, ...]  # placement of the gradient handed back to each input
    output: str
    output_grad: str  # placement the output's gradient must arrive in
    params: tuple[str, ...]  # tp placement of each parameter read: R, S(0), S(1)
    split: bool  # compute (and the sharded tensors) divided by the tp degree
    stats: int = 0  # fp32 all-reduces of one value per row (vocab-parallel softmax / loss)

    @property
    def splits_a_parameter(self) -> bool:
        """What makes a tp axis tensor parallel: see [Note: a tp axis must split a parameter] in solver.py."""
        return any(p != "R" for p in self.params)


# Forward: what turning a producer's placement into a consumer's costs (None: free).
# P -> S all-reduces and slices: a row Linear's output is reduced whole, as Megatron's g does.
FORWARD_CONVERT = {("S", "R"): "all_gather", ("P", "R"): "all_reduce", ("P", "S"): "all_reduce"}
# Backward: gradients arriving in one placement, wanted in another. P -> S is the
# reduce-scatter that autograd makes of a forward all-gather.
BACKWARD_CONVERT = {("S", "R"): "all_gather", ("P", "R"): "all_reduce", ("P", "S"): "reduce_scatter"}

LOSS_STATS = 3  # vocab-parallel cross-entropy: row max, sum of exponentials, target logit
SOFTMAX_STATS = 2  # row max, sum of exponentials


def _uniform(name: str, op: Op, placement: str, params: tuple[str, ...], split: bool, stats: int = 0) -> Candidate:
    n = len(op.inputs)
    return Candidate(name, (placement,) * n, (placement,) * n, placement, placement, params, split, stats)


def replicate(op: Op) -> Candidate:
    return _uniform("replicate", op, "R", ("R",) * len(op.params), split=False)


def _linear(op: Op, tp: int) -> list[Candidate]:
    out_features, in_features = op.param_shapes[0]
    bias = len(op.params) > 1
    found = []
    if out_features % tp == 0:
        found.append(Candidate("column", ("R",), ("P",), "S", "S", ("S(0)", "S(0)")[: len(op.params)], True))
    if in_features % tp == 0:
        found.append(Candidate("row", ("S",), ("S",), "P", "R", ("S(1)", "R") if bias else ("S(1)",), True))
    return found


def _embedding(op: Op, tp: int) -> list[Candidate]:
    if op.param_shapes[0][0] % tp:
        return []
    return [Candidate("vocab", ("R",), ("R",), "P", "R", ("S(0)",), True)]


def _attention(op: Op, tp: int) -> list[Candidate]:
    heads = [shape[-3] for shape in op.input_shapes[:3] if len(shape) >= 3]
    if len(heads) < 3 or any(h % tp for h in heads):
        return []
    rest = ("R",) * (len(op.inputs) - 3)  # an attention mask broadcasts over heads
    return [Candidate("shard", ("S",) * 3 + rest, ("S",) * 3 + rest, "S", "S", (), True)]


def _softmax_or_loss(op: Op, tp: int) -> list[Candidate]:
    if op.input_shapes[0][-1] % tp:
        return []
    if op.kind == "softmax":
        return [_uniform("shard", op, "S", (), True, SOFTMAX_STATS)]
    rest = ("R",) * (len(op.inputs) - 1)  # the targets
    return [Candidate("shard", ("S",) + rest, ("S",) + rest, "R", "R", (), True, LOSS_STATS)]


def _pointwise(op: Op, tp: int) -> list[Candidate]:
    last = op.output_shape[-1] if op.output_shape else 0
    if not last or last % tp or any(s[-1:] != (last,) for s in op.input_shapes):
        return []
    if any(shape != (last,) for shape in op.param_shapes):  # a per-feature scale follows the shard
        return []
    return [_uniform("shard", op, "S", ("S(0)",) * len(op.params), True)]


def _matmul(op: Op, tp: int) -> list[Candidate]:
    """Activation @ activation with batch dimensions (attention written by hand): heads shard."""
    if len(op.input_shapes) != 2 or any(len(s) < 3 or s[-3] % tp for s in op.input_shapes):
        return []
    return [_uniform("shard", op, "S", (), True)]


SHARDED = {
    "linear": _linear,
    "embedding": _embedding,
    "attention": _attention,
    "softmax": _softmax_or_loss,
    "loss": _softmax_or_loss,
    "pointwise": _pointwise,
    "matmul": _matmul,
}


def candidates(op: Op, tp: int) -> tuple[Candidate, ...]:
    """``replicate`` first, then whatever ``tp`` divides; only ``replicate`` without a tp axis."""
    rule = SHARDED.get(op.kind)
    if tp == 1 or rule is None:
        return (replicate(op),)
    return (replicate(op), *rule(op, tp))
