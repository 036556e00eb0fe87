"""Schedule pass: issue each all-gather ahead of its use, at most N in flight."""

from __future__ import annotations

import torch.fx as fx

from dpar.compiler.collectives import WAIT
from dpar.compiler.passes.all_gather import c10d, operand_chain
from dpar.compiler.propagation.redistribute import ACTIVATION_COLLECTIVE


def prefetch_all_gathers_pass(gm: fx.GraphModule, max_inflight: int) -> fx.GraphModule:
    """Move gather k to right after the wait of gather k - max_inflight (the first ones to the top).

    Gathers are taken in the order their data is first needed, so while the
    compute that uses gather k-1 runs, up to ``max_inflight`` gathers are in
    flight; the bound caps the gathered memory prefetch holds.
    """
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    gathers = [  # of parameters: tensor parallel's gathers of activations stay where their data is made
        n for n in graph.nodes
        if n.target is c10d.all_gather_into_tensor.default and not n.meta.get(ACTIVATION_COLLECTIVE)
    ]
    waits = {g: min((u for u in g.users if u.target is WAIT), key=position.__getitem__) for g in gathers}
    gathers.sort(key=lambda g: position[waits[g]])
    top = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for k, gather in enumerate(gathers):
        chain = operand_chain(gather)
        if any(a.op != "placeholder" and a not in chain for n in chain for a in n.all_input_nodes):
            continue  # its operand depends on compute: it cannot move above it
        anchor = top if k < max_inflight else waits[gathers[k - max_inflight]]
        chain.sort(key=position.__getitem__)
        for node in reversed(chain):
            anchor.append(node)
        position = {n: i for i, n in enumerate(graph.nodes)}
        if k < max_inflight:
            top = gather
    graph.lint()
    gm.recompile()
    return gm
