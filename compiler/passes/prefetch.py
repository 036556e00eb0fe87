"""Schedule pass: issue each all-gather ahead of its use, at most N in flight; N from cost.

[Note: the prefetch distance]
Gathers in need order: gather k's data is needed once ``need_s[k]`` seconds of
compute (the roofline of ``costs.node_cost``) have run; its all-gather takes
``comm_s[k]`` (the part that can hide under compute, ``overlap`` of it), and the
gathers run one after another. At distance d gather k is issued when gather
k - d is waited for (the first d at the top), and a wait whose gather has not
finished stalls the compute. Memory bounds d: the d gathers in flight at once
hold their full buffers, at most ``cap_bytes`` together (d >= 1 whatever the
sizes). A larger d never issues a gather later, so the stall shrinks as d
grows; the bound chosen is the smallest d that stalls no longer than the
largest the memory allows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from dpar.compiler.collectives import WAIT
from dpar.compiler.costs import DeviceSpec, comm_time, compute_done, payload_bytes
from dpar.compiler.passes.all_gather import c10d, operand_chain
from dpar.compiler.propagation.redistribute import ACTIVATION_COLLECTIVE
from dpar.compiler.graph_utils import with_code


def gathers_by_need(graph: fx.Graph) -> tuple[list[fx.Node], dict[fx.Node, fx.Node]]:
    """The parameters' all-gathers in the order their data is first needed, and each one's first wait."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    gathers = [  # of parameters: tensor parallel's gathers of activations stay where their data is made
        n for n in graph.nodes
        if n.target is c10d.all_gather_into_tensor.default and not n.meta.get(ACTIVATION_COLLECTIVE)
    ]
    waits = {g: min((u for u in g.users if u.target is WAIT), key=position.__getitem__) for g in gathers}
    gathers.sort(key=lambda g: position[waits[g]])
    return gathers, waits


def prefetch_distance(gm: fx.GraphModule, spec: DeviceSpec, world_size: int, cap_bytes: int) -> int:
    """The in-flight bound from cost: the smallest whose gathers are as early as the largest the
    memory bound allows would make them (see [Note: the prefetch distance])."""
    gathers, waits = gathers_by_need(gm.graph)
    done = compute_done(gm, spec)
    sizes = [payload_bytes(g) for g in gathers]
    hidable = [spec.overlap * comm_time("all_gather", n, world_size, spec) for n in sizes]
    return choose_distance([done[waits[g]] for g in gathers], hidable, sizes, cap_bytes)


def choose_distance(need_s: Sequence[float], comm_s: Sequence[float], sizes: Sequence[int], cap_bytes: int) -> int:
    """The bound from per-gather figures, in need order ([Note: the prefetch distance])."""
    k = len(need_s)
    allowed = 1
    while allowed < k and all(sum(sizes[i:i + allowed + 1]) <= cap_bytes for i in range(k - allowed)):
        allowed += 1
    least = _stall(need_s, comm_s, allowed)
    return next(d for d in range(1, allowed + 1) if _stall(need_s, comm_s, d) <= least + max(1e-12, 1e-9 * least))


def _stall(need_s: Sequence[float], comm_s: Sequence[float], distance: int) -> float:
    """Seconds the compute waits for gathers at ``distance`` ([Note: the prefetch distance])."""
    waited: list[float] = []  # wall time at which each wait returns
    finish, stall = 0.0, 0.0
    for k, (need, comm) in enumerate(zip(need_s, comm_s)):
        issued = waited[k - distance] if k >= distance else 0.0
        finish = max(issued, finish) + comm
        reached = need + stall  # the compute reaches the wait after every stall before it
        stall += max(0.0, finish - reached)
        waited.append(max(reached, finish))
    return stall


def prefetch_all_gathers_pass(gm: fx.GraphModule, max_inflight: int) -> fx.GraphModule:
    """Move gather k to right after the wait of gather k - max_inflight (the first ones to the top).

    Gathers are taken in the order their data is first needed, so while the
    compute that uses gather k-1 runs, up to ``max_inflight`` gathers are in
    flight; the bound caps the gathered memory prefetch holds.
    """
    graph = gm.graph
    gathers, waits = gathers_by_need(graph)
    position = {n: i for i, n in enumerate(graph.nodes)}
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
    return with_code(gm)
