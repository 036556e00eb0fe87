"""Schedule pass: each wait (and the views of its result) as late as the graph allows."""

from __future__ import annotations

import torch.fx as fx

from dpar.compiler.collectives import WAIT, is_compute


def _view_closure(wait: fx.Node) -> list[fx.Node]:
    """The wait and the non-compute nodes (split, getitem, view) that only reshape its result."""
    closure, frontier = [wait], [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and not is_compute(user) and user not in closure:
                if all(arg in closure for arg in user.all_input_nodes):
                    closure.append(user)
                    frontier.append(user)
    return closure


def sink_waits_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Move every wait_tensor down to just before the first node that needs its data.

    Between the collective and its wait, the rest of the graph runs while the
    communication is in flight. The reshaping that follows a wait moves with it.
    """
    graph = gm.graph
    for wait in [n for n in graph.nodes if n.target is WAIT]:
        closure = _view_closure(wait)
        position = {n: i for i, n in enumerate(graph.nodes)}
        closure.sort(key=position.__getitem__)
        members = set(closure)
        consumers = [u for n in closure for u in n.users if u not in members]
        first_consumer = min(consumers, key=position.__getitem__, default=graph.output_node())
        for node in closure:
            first_consumer.prepend(node)
    graph.lint()
    gm.recompile()
    return gm
