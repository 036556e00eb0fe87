"""Reading buckets back out of the graphs, as dpar's passes built them.

Reading the graph rather than the bucket plan shows what the graph really
does. A gradient bucket is the set of graph outputs (parameter gradients) that
a collective's result reaches through views alone (all-reduce, reduce-scatter;
a tied parameter's gradient adds the pieces of its uses);
a parameter bucket is the set of graph inputs (parameter shards) an all-gather
concatenates. Positions are flat (AOTAutograd) positions: ``names`` maps them
to parameter names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx as fx

from dpar.compiler.collectives import COLLECTIVE_KINDS, WAIT, is_compute
from dpar.compiler.costs import payload_bytes
from dpar.compiler.lowering import flat_inputs
from dpar.compiler.propagation.redistribute import ACTIVATION_COLLECTIVE
from dpar.compiler.passes.all_gather import operand_chain


@dataclasses.dataclass(frozen=True)
class GraphBucket:
    """The parameters one collective carries, in flattening order."""

    collective_node: str
    kind: str
    dtype: torch.dtype
    positions: tuple[int, ...]  # backward outputs (gradients) or graph inputs (shards), flat
    nbytes: int  # the full buffer: gathered, or before the scatter


def _carries_gradient(node: fx.Node) -> bool:
    """A view of a reduced gradient, or a sum of such (a tied parameter's pieces, one per use)."""
    return node.op == "call_function" and (
        not is_compute(node) or getattr(node.target, "is_view", False) or node.target is torch.ops.aten.add.Tensor
    )


def _reached_outputs(wait: fx.Node, output: fx.Node) -> list[fx.Node]:
    """Nodes returned by the graph that are views of ``wait``'s result, in graph order."""
    reached, frontier, seen = [], [wait], {wait}
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user is output:
                reached.append(node)
            elif user not in seen and _carries_gradient(user):
                seen.add(user)
                frontier.append(user)
    position = {n: i for i, n in enumerate(wait.graph.nodes)}
    return sorted(set(reached), key=position.__getitem__)


def _gathered_inputs(gather: fx.Node) -> list[int]:
    """Flat input positions of the shards an all-gather concatenates, in concatenation order."""
    flat = {node: i for i, node in flat_inputs(gather.graph).items()}
    position = {n: i for i, n in enumerate(gather.graph.nodes)}
    chain = sorted(operand_chain(gather), key=position.__getitem__)
    read = [a for n in chain for a in n.all_input_nodes if a in flat]
    return [flat[p] for p in dict.fromkeys(read)]


def _bucket(node: fx.Node, kind: str, positions: Sequence[int]) -> GraphBucket:
    return GraphBucket(node.name, kind, node.args[0].meta["val"].dtype, tuple(positions), payload_bytes(node))


def graph_buckets(gm: fx.GraphModule, *, gradients: bool) -> list[GraphBucket]:
    """Parameter buckets (all-gathers), and with ``gradients`` the gradient buckets too, in graph order."""
    output = gm.graph.output_node()
    returned = list(output.args[0])
    buckets = []
    for node in gm.graph.nodes:
        kind = COLLECTIVE_KINDS.get(node.target)
        waits = [u for u in node.users if u.target is WAIT]
        if kind is None or not waits:
            continue
        if node.meta.get(ACTIVATION_COLLECTIVE):  # tensor parallel moving activations: no parameter bucket
            continue
        if kind == "all_gather":
            buckets.append(_bucket(node, kind, _gathered_inputs(node)))
        elif gradients and (reached := _reached_outputs(waits[0], output)):
            buckets.append(_bucket(node, kind, [i for r in reached for i, n in enumerate(returned) if n is r]))
    return buckets


def bucket_of(buckets: Sequence[GraphBucket], node_name: str) -> int | None:
    for i, b in enumerate(buckets):
        if b.collective_node == node_name:
            return i
    return None
