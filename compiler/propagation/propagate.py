"""Give every value of a graph a placement, inserting the cheapest redistribution where a consumer needs another.

One forward sweep in graph order (the joint graph's order is the forward, then
the backward): each node takes the candidate of its rule whose inputs cost the
least to reach (``redistribute.cost``); ties go to the rule's order, which
lists sharded candidates first so work stays split. Placements are recorded in
``node.meta["placement"]`` (``"placement_outputs"`` for ops with several
outputs); the shapes in the graph stay global until ``localize`` runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

import dpar.runtime.tensor_parallel  # noqa: F401  (registers the marker ops)
from dpar.core.errors import TensorParallelPlanError
from dpar.core.plan import ATTENTION_EXCHANGES
from dpar.compiler.propagation.context_rules import (
    ATTENTION_EXCHANGE,
    context_candidates,
    gathered_bytes,
    repeats_a_split_value,
    sliced_inputs,
)
from dpar.compiler.propagation.redistribute import SLICE_COST, cost, nbytes_of, redistribute
from dpar.compiler.propagation.rules import (
    TRANSPOSES,
    Candidate,
    candidates_for,
    sequence_shard,
    tensor_inputs,
    transpose_order,
)

WEIGHT_MARKER = torch.ops.dpar.tensor_parallel_weight.default
GRAD_MARKER = torch.ops.dpar.tensor_parallel_grad.default


@dataclasses.dataclass(frozen=True)
class MeshDim:
    """The mesh dimension propagation places values over (tensor or context parallel), as this rank sees it."""

    size: int
    rank: int
    group_name: str
    sequence_parallel: bool = False
    period: int = 0
    """A context-parallel axis: the sequence length, whose runs a shard splits in two chunks per rank
    ([Note: a sequence's two chunks per rank]); 0 for a tensor-parallel axis (contiguous blocks)."""
    attention_exchange: str | None = None
    """A context-parallel axis: the exchange every attention takes (``ATTENTION_EXCHANGES``); None: the cheaper."""


WASTED_WORK = SLICE_COST
"""Slicing a result after computing all of it costs the other ranks' share of the work:
priced above slicing an input, so that a gradient is computed as the block it becomes."""


def _wanted_by_gradients(graph: fx.Graph) -> dict[fx.Node, Placement]:
    """The block each parameter gradient's producers should hand over: the gradient marker's
    Shard(dim), carried back through transposes and sums of same-shaped gradients (tied weights)."""
    wanted: dict[fx.Node, Placement] = {}
    for node in reversed(graph.nodes):
        if node.target is GRAD_MARKER:
            wanted[node.args[0]] = Shard(node.args[1])
        elif node in wanted and node.target in TRANSPOSES:
            wanted[node.args[0]] = Shard(transpose_order(node)[wanted[node].dim])
        elif node in wanted and node.target is torch.ops.aten.add.Tensor:
            for value in tensor_inputs(node):
                if value.meta["val"].shape == node.meta["val"].shape:
                    wanted[value] = wanted[node]
    return wanted


def _choose(node: fx.Node, candidates: list[Candidate], mesh: MeshDim, wanted: Placement | None,
            made: Collection[tuple[fx.Node, Placement]], foreseen: Collection[tuple[str, Placement]],
            blocks: Collection[fx.Node]) -> Candidate:
    """The candidate whose inputs are cheapest to reach (with the collectives it runs itself), counting the
    hand-over to a parameter gradient's block where the node computes one (that placement is fixed, so known now).
    Over cp a value wanted whole is gathered before any repeat of it (``_Redistributor.to``), and priced so.
    See [Note: a reduction already made is free].
    """
    inputs = tensor_inputs(node)
    size = mesh.size

    def nbytes(value: fx.Node, want: Placement) -> int:
        return gathered_bytes(value) if mesh.period and want == Replicate() else nbytes_of(value)

    def reach(value: fx.Node, want: Placement) -> float:
        source = relaid_source(value, mesh.period) if want == Replicate() else None
        while source is not None and (value, want) not in made and (value.name, want) not in foreseen:
            value, source = source, relaid_source(source, mesh.period)  # a view of a value made whole already is free
        if (value, want) in made or (value.name, want) in foreseen:
            return 0.0
        here = value.meta.get("placement", Replicate())
        if value in blocks and isinstance(here, Shard) and here != want:
            return math.inf  # a parameter keeps the split its plan gave it
        return cost(here, want, nbytes(value, want), size)

    def price(candidate: Candidate) -> tuple[float, int]:
        moved = candidate.inner + sum(reach(n, want) for n, want in zip(inputs, candidate.inputs))
        if wanted is not None and candidate.outputs[0] != wanted:
            moved += cost(candidate.outputs[0], wanted, nbytes_of(node), size) + WASTED_WORK
        return moved, sum(out == Partial() for out in candidate.outputs)

    return min(candidates, key=price)  # min keeps the first of equals


# [Note: a reduction already made is free]
# Each node is placed greedily, by what reaching its candidate's inputs costs. A value redistributed for one consumer
# exists from then on (``_Redistributor.made``), so a later consumer that takes it in the same placement moves
# nothing: pricing it again as a fresh collective made a partial sum look cheaper to carry on than its reduction to
# reuse. And a split parameter keeps its plan's split: turning it into another split (an all-to-all of the weight
# every step) is not offered, since the plan chose the split for the layer and a greedy sweep cannot see the
# reduction the other split would owe later. Both showed on Hugging Face's Llama: its RMSNorm reads the
# vocabulary-parallel embedding's partial sum twice (whole for the variance, reduced, and to scale it); priced as a
# fresh all-reduce the scaled value stayed partial, and under sequence parallel the norm's token-split output was
# cheaper to turn feature-split than to gather: either way the q, k and v projections ran row-split on re-split
# weights, q, k and v were all-reduced, and attention ran on every head on every rank (8 times the attention a
# rank of 8 should do; Llama-3-8B's graphs on 8 x 8 held 20.4 GB where its plan counted 4.0). Of two candidates that
# cost the same, the one that leaves fewer partial sums pending wins: carrying one through an op of its size never
# makes its reduction smaller.
# What one sweep cannot know is a conversion a later consumer will make: a norm's backward reads the incoming partial
# gradient twice, the first reader carried it on as a partial sum, the second reduced it, and the first's result was
# reduced again downstream. So the sweep runs twice: a rehearsal on a copy of the graph, then the real one, which
# prices every conversion the rehearsal made as free (``foreseen``, by value name). And a view or transpose of a
# partial sum that must be reduced is reduced at the sum and viewed after (``relaid_source``), so the sum's readers
# share one reduction; not for the graph's outputs, whose reductions (cp's parameter gradients) the gradient
# passes find as the outputs' producers and bucket. On the tests' HF Llama under tp the backward's all-reduces fell
# from 8 to Megatron's 5 (two a layer and the head's), with sequence parallel its reduce-scatters from 10 to 6.
# A split value's view or transpose wanted whole is gathered at its source the same way (over tp; cp's gathers
# reorder chunks and are left as they are): under sequence parallel a row-parallel layer's backward gathered the
# incoming gradient once for the input's gradient and once more, transposed, for the weight's (Llama-3-8B cut to
# 2 layers on 8 x 8: 112 gathers a backward where Megatron-SP runs 80).


_CONTRACTIONS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default}
_RELAYOUTS = TRANSPOSES | {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default,
                           torch.ops.aten.detach.default, torch.ops.aten.clone.default}
LOW_PRECISION = {torch.bfloat16, torch.float16}


def _accumulate_in_fp32(graph: fx.Graph, node: fx.Node) -> None:
    """A low-precision product that is a partial sum is computed in fp32 and rounded after: its
    reduction then takes the fp32 sum (``redistribute`` reduces before the casts), and the
    rounding happens once, on the whole sum, as on one device. See [Note: partial sums in low precision]."""
    val = node.meta["val"]
    if val.dtype not in LOW_PRECISION:
        return
    with graph.inserting_before(node):
        for value, placement in zip(tensor_inputs(node), node.meta["placement_inputs"]):
            wide = graph.call_function(torch.ops.aten._to_copy.default, (value,), {"dtype": torch.float32})
            wide.meta["val"], wide.meta["placement"] = value.meta["val"].to(torch.float32), placement
            node.replace_input_with(value, wide)
    with graph.inserting_after(node):
        narrow = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": val.dtype})
    narrow.meta["val"], narrow.meta["placement"] = val, node.meta["placement"]
    node.replace_all_uses_with(narrow, delete_user_cb=lambda user: user is not narrow)
    node.meta["val"] = val.to(torch.float32)


def _relaid(node: fx.Node) -> fx.Node | None:
    """The one tensor ``node`` views or transposes, if it is such a relayout (the same values, laid out anew)."""
    if node.target not in _RELAYOUTS:
        return None
    inputs = tensor_inputs(node)
    return inputs[0] if inputs == [node.args[0]] else None


def relaid_source(value: fx.Node, period: int) -> fx.Node | None:
    """The value ``value`` views or transposes where both are partial sums, or (off cp: no ``period``) both split:
    made whole, it is made whole there and relaid. See [Note: a reduction already made is free]."""
    source = _relaid(value)
    if source is None:
        return None
    here, there = value.meta.get("placement"), source.meta.get("placement")
    if here == Partial() and there == Partial():
        return source
    return source if not period and isinstance(here, Shard) and isinstance(there, Shard) else None


class _Redistributor:
    """Inserts each (value, placement) conversion once, before its first consumer."""

    def __init__(self, graph: fx.Graph, mesh: MeshDim) -> None:
        self.graph, self.mesh = graph, mesh
        self.made: dict[tuple[fx.Node, Placement], fx.Node] = {}

    def to(self, value: fx.Node, want: Placement, consumer: fx.Node) -> fx.Node:
        here = value.meta.get("placement", Replicate())
        if here == want:
            return value
        key = (value, want)
        wants = sliced_inputs(value, want, self.mesh.period) if self.mesh.period and here == Replicate() else None
        if wants is not None and key not in self.made:  # computed split: see [Note: slicing before computing]
            with self.graph.inserting_before(consumer):
                split = self.graph.node_copy(value)
            for source, source_want in zip(tensor_inputs(value), wants):
                split.replace_input_with(source, self.to(source, source_want, split))
            split.meta.update(placement_inputs=wants, placement=want)
            self.made[key] = split
        if self.mesh.period and want == Replicate() and key not in self.made and repeats_a_split_value(value):
            whole = self.to(tensor_inputs(value)[0], want, consumer)  # gathered before it is repeated
            with self.graph.inserting_before(consumer):
                repeated = self.graph.node_copy(value, lambda n: whole if n is tensor_inputs(value)[0] else n)
            repeated.meta.update(placement_inputs=(want,), placement=want)
            self.made[key] = repeated
        source = relaid_source(value, self.mesh.period) if consumer.op != "output" else None  # see the Note
        if source is not None and want == Replicate() and key not in self.made:  # reduced once, at its source
            whole = self.to(source, want, consumer)
            with self.graph.inserting_before(consumer):
                replayed = self.graph.node_copy(value, lambda n: whole if n is source else n)
            replayed.meta.update(placement_inputs=(want,), placement=want)
            self.made[key] = replayed
        if key not in self.made:
            with self.graph.inserting_before(consumer):
                self.made[key] = redistribute(
                    self.graph, value, here, want,
                    tp=self.mesh.size, rank=self.mesh.rank, group_name=self.mesh.group_name, period=self.mesh.period,
                )
        return self.made[key]


def propagate_placements(gm: fx.GraphModule, mesh: MeshDim) -> fx.GraphModule:
    """Placements for every value, redistributions where they disagree; graph outputs come out replicated
    (parameter gradients as their parameter's block).

    A placement describes the value as traced: ``Replicate`` means every rank
    holds the traced tensor itself. Placeholders (and the gradient markers'
    outputs) are local data that way, split parameters' blocks included;
    ``Shard``/``Partial`` values exist only between the markers, where the
    traced shapes are global.
    """
    rehearsal = fx.Graph()  # see [Note: a reduction already made is free]
    rehearsal.output(rehearsal.graph_copy(gm.graph, {}))
    foreseen = {(value.name, want) for value, want in _sweep(rehearsal, mesh, frozenset())[0]}
    read_whole = _sweep(gm.graph, mesh, foreseen)[1]
    if read_whole:
        raise _unproven_split(read_whole)
    if mesh.period:  # what was computed whole only to be sliced
        gm.graph.eliminate_dead_code()
    gm.graph.lint()
    return gm


def _sweep(graph: fx.Graph, mesh: MeshDim, foreseen: Collection[tuple[str, Placement]],
           ) -> tuple[Collection[tuple[fx.Node, Placement]], dict[fx.Node, fx.Node]]:
    """One greedy pass placing ``graph``'s nodes in order: the conversions it made, and the split parameters an op
    read whole (with that op). ``foreseen``: conversions (by value name) a first pass made, priced as free."""
    move = _Redistributor(graph, mesh)
    wanted = _wanted_by_gradients(graph)
    read_whole: dict[fx.Node, fx.Node] = {}  # split parameter -> the first op that needs all of it
    blocks: set[fx.Node] = set()  # split parameters and their views: see [Note: a reduction already made is free]
    for node in list(graph.nodes):
        if node.op == "placeholder":
            node.meta["placement"] = Replicate()  # data, replicated parameters, tangents, and local blocks
        elif node.op == "output":
            outputs = [
                move.to(n, Replicate(), node)
                if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) else n
                for n in node.args[0]
            ]
            node.args = (type(node.args[0])(outputs),)
        elif node.op == "call_function":
            if node.target is WEIGHT_MARKER:
                node.meta["placement"] = Shard(node.args[1])
                blocks.add(node)
                continue
            if _relaid(node) in blocks:
                blocks.add(node)  # the same block, viewed (a Linear's weight is read transposed)
            if node.target is GRAD_MARKER:
                # Its traced value is this rank's block, as a placeholder's is: nothing to rewrite after it.
                chosen = Candidate((Shard(node.args[1]),), (Replicate(),))
            else:
                candidates = (context_candidates(node, mesh.size, mesh.period, mesh.attention_exchange) if mesh.period
                              else candidates_for(node, mesh.size))
                if mesh.sequence_parallel:
                    candidates += sequence_shard(node, mesh.size)
                chosen = _choose(node, candidates, mesh, wanted.get(node), move.made, foreseen, blocks)
                if chosen.name in ATTENTION_EXCHANGES:
                    node.meta[ATTENTION_EXCHANGE] = chosen.name
            for value, want in zip(tensor_inputs(node), chosen.inputs):
                if value.target is WEIGHT_MARKER and want == Replicate():
                    read_whole.setdefault(value, node)
                node.replace_input_with(value, move.to(value, want, node))
            node.meta["placement_inputs"] = chosen.inputs
            if isinstance(node.meta.get("val"), (tuple, list)):
                node.meta["placement_outputs"] = chosen.outputs
            else:
                node.meta["placement"] = chosen.outputs[0]
                if node.target in _CONTRACTIONS and chosen.outputs[0] == Partial():
                    _accumulate_in_fp32(graph, node)
    return move.made, read_whole


def _parameter_name(marker: fx.Node) -> str:
    return marker.args[5] if len(marker.args) > 5 else marker.kwargs.get("name", str(marker.args[0]))


def _unproven_split(read_whole: dict[fx.Node, fx.Node]) -> TensorParallelPlanError:
    """[Note: a split no rule keeps]
    A split parameter whose consumer has no rule that takes its block (a
    convolution, BatchNorm, a grouped expert matmul, anything ``rules.RULES``
    does not list) would be all-gathered whole before that op on every step: the
    numbers stay right, but the split saves nothing and costs a gather per use,
    and it means the plan asked for a layout the graph does not have. So the
    plan is refused, naming the parameter and the op; the automatic plan never
    splits such a parameter (``megatron.py`` splits Linears and tied embeddings only)."""
    lines = [
        f"{_parameter_name(marker)} (split along dim {marker.args[1]}) is read whole by "
        f"{getattr(consumer.target, '__name__', consumer.target)}"
        for marker, consumer in read_whole.items()
    ]
    names = ", ".join(f"{_parameter_name(marker)!r}: None" for marker in read_whole)
    return TensorParallelPlanError(
        "the tensor-parallel plan splits parameters that an op reads whole, which sharding propagation has no "
        "rule to keep split (convolutions, BatchNorm, grouped expert matmuls and ops without a rule run "
        "replicated): " + "; ".join(lines) + f". Keep them replicated (tp_plan={{{names}, ...}}), or leave "
        "tp_plan out: the automatic plan splits only the Linears it can pair"
    )
