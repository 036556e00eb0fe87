"""Schedule pass, gloo only: each all-gather runs alone, with nothing else in flight, and is waited at once.

[Note: an all-gather alone on gloo]
An all-gather on a gloo process group while another collective of that group is in flight corrupts the heap
of the process (torch 2.13.0 and 2.14.1: gloo's ``allgather_into_tensor_coalesced``, which the functional
``all_gather_into_tensor`` runs on, on one of the group's two worker threads while the other runs the other
collective). ``benchmarks/gloo_all_gather_race.py`` shows it without dpar, four ranks, functional collectives
on a 2-rank sub-group, 60 s a run: all-gathers four in flight, a rank died (glibc's "malloc(): unaligned
tcache chunk detected" or SIGSEGV) in every run; each all-gather waited at once but all-reduces in flight
beside it, in 2 of 3; all-gathers one at a time with nothing else in flight, all-reduces or reduce-scatters
four in flight, in none. It was the crash of dpar's tensor-parallel runs on gloo (the GPT's forward under tp
issues its attention's gathers together; sunk waits and prefetched fsdp gathers keep others in flight): the
core of one showed the heap corrupted inside a gloo worker's all-gather, at a tensor's version counter freed
twice.

So on gloo, before an all-gather is issued every collective still in flight is waited, and its own wait
follows it: the gather overlaps nothing on CPU ranks, and the other collectives keep their overlap between
gathers. Applied to each graph as it is lowered (the graphs a gloo run records show it). NCCL (its own
streams) and the fake process group (inspection, planning) run the graphs as planned.
"""

from __future__ import annotations

import operator

import torch.distributed as dist
import torch.fx as fx

from dpar.compiler.collectives import WAIT, is_communication
from dpar.core.torch_internals import C10D_FUNCTIONAL, resolve_process_group

_ALL_GATHERS = (C10D_FUNCTIONAL.all_gather_into_tensor.default, C10D_FUNCTIONAL.all_gather_into_tensor_coalesced.default)


def isolate_all_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Move the waits of collectives in flight to just before each all-gather, and its own wait (through the
    ``getitem`` of a coalesced one) to just after it."""
    pending: list[fx.Node] = []  # waits of the collectives issued so far, not yet passed
    for node in list(gm.graph.nodes):
        if node.target in _ALL_GATHERS:
            for wait in pending:
                node.prepend(wait)
            pending.clear()
            anchor = node
            for part in _parts(node):
                if part is not node:
                    anchor.append(part)
                    anchor = part
                for wait in _waits(part):
                    anchor.append(wait)
                    anchor = wait
        elif node.target is WAIT:
            if node in pending:
                pending.remove(node)
        elif is_communication(node):
            pending += [wait for part in _parts(node) for wait in _waits(part)]
    gm.graph.lint()
    gm.recompile()
    return gm


def _parts(collective: fx.Node) -> list[fx.Node]:
    """A coalesced collective's ``getitem`` nodes, or the collective itself."""
    return [u for u in collective.users if u.target is operator.getitem] or [collective]


def _waits(part: fx.Node) -> list[fx.Node]:
    return [u for u in part.users if u.target is WAIT]


def on_gloo(group_name: str) -> bool:
    """Whether the process group named ``group_name`` runs on gloo (see [Note: an all-gather alone on gloo])."""
    return dist.get_backend(resolve_process_group(group_name)) == "gloo"
