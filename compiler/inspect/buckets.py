"""Reading gradient buckets back out of a backward graph, as the all-reduce pass built them.

Reading the graph rather than the bucket plan shows what the graph really
does: a bucket is the set of graph outputs (parameter gradients) that a
collective's result reaches through views alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx as fx

from dpar.compiler.collectives import COLLECTIVE_KINDS, WAIT, is_compute


@dataclasses.dataclass(frozen=True)
class GraphBucket:
    """The gradients one collective carries, in flattening order."""

    collective_node: str
    kind: str
    dtype: torch.dtype
    output_indices: tuple[int, ...]  # backward output == forward input index
    nbytes: int


def _reached_outputs(wait: fx.Node, output: fx.Node) -> list[fx.Node]:
    """Nodes returned by the graph that are views of ``wait``'s result, in graph order."""
    reached, frontier, seen = [], [wait], {wait}
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user is output:
                reached.append(node)
            elif user not in seen and user.op == "call_function" and not is_compute(user):
                seen.add(user)
                frontier.append(user)
    position = {n: i for i, n in enumerate(wait.graph.nodes)}
    return sorted(set(reached), key=position.__getitem__)


def graph_buckets(gm: fx.GraphModule) -> list[GraphBucket]:
    """One bucket per collective whose result is returned (gradient all-reduce, reduce-scatter)."""
    output = gm.graph.output_node()
    returned = list(output.args[0])
    buckets = []
    for node in gm.graph.nodes:
        kind = COLLECTIVE_KINDS.get(node.target)
        waits = [u for u in node.users if u.target is WAIT]
        if kind is None or not waits:
            continue
        reached = _reached_outputs(waits[0], output)
        if not reached:
            continue
        indices = tuple(i for r in reached for i, n in enumerate(returned) if n is r)
        val = node.args[0].meta["val"]
        buckets.append(
            GraphBucket(node.name, kind, val.dtype, indices, int(val.numel()) * val.element_size())
        )
    return buckets


def bucket_of(buckets: Sequence[GraphBucket], node_name: str) -> int | None:
    for i, b in enumerate(buckets):
        if b.collective_node == node_name:
            return i
    return None
