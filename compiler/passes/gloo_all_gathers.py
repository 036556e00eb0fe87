"""Lowering, gloo only: an all-gather runs as an all-reduce of this rank's block placed among zeros.

[Note: no all-gather on gloo]
gloo's all-gather corrupts the heap of the process (torch 2.13.0 and 2.14.1: ``allgather_into_tensor_coalesced``,
which the functional ``all_gather_into_tensor`` runs on; ``benchmarks/gloo_all_gather_race.py`` shows it without
dpar: four ranks, functional collectives on a 2-rank sub-group, every run of 40-60 s with all-gathers in flight
together died of glibc's "malloc(): unaligned tcache chunk detected" or SIGSEGV, as did runs where the inputs
were kept alive past their waits; the same schedules of all-reduces, or of reduce-scatters, which gloo runs as
all-reduces, never did). It was the crash of dpar's tensor-parallel runs on gloo: the core of one showed the heap
corrupted inside a gloo worker's all-gather, at a tensor's version counter freed twice. Waiting every other
collective before each all-gather made it rarer, not gone: a torchtitan Llama 3 fsdp+tp run whose graphs held one
collective in flight at any time still died of SIGSEGV in the suite.

So on gloo no all-gather runs: each rank pads its block with zeros to the gathered shape, its own rows in place,
and the group all-reduces it with a sum. Adding zeros is exact, so the values are the gather's bit for bit (but a
-0.0, which comes back +0.0); the ring moves twice a gather's bytes, and the padded block and the reduced copy
hold the gathered shape twice at the issue, as gloo's gather staged it
([Note: gloo stages its gathers and reductions] in compiler/memory.py). The graphs are recorded and checked
across ranks as planned, with their all-gathers (what NCCL runs, and what ``dpar inspect`` shows); the rewrite is
applied to a copy just before it is lowered. NCCL and the fake process group run the gathers.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
import torch.fx as fx

from dpar.compiler.graph_utils import copy_graph_module
from dpar.core.torch_internals import C10D_FUNCTIONAL, resolve_process_group

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL
_GATHER = c10d.all_gather_into_tensor.default
_GATHERS = (_GATHER, c10d.all_gather_into_tensor_coalesced.default)


def as_run_on_gloo(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` itself where none of its all-gathers is on a gloo group; otherwise a copy whose all-gathers on
    gloo groups are all-reduces of zero-padded blocks (see [Note: no all-gather on gloo])."""
    if not any(n.target in _GATHERS and on_gloo(n.args[2]) for n in gm.graph.nodes):
        return gm
    gm = copy_graph_module(gm)
    graph = gm.graph
    for node in [n for n in graph.nodes if n.target in _GATHERS and on_gloo(n.args[2])]:
        blocks, size, group = node.args
        if node.target is _GATHER:
            node.replace_all_uses_with(_summed(graph, node, blocks, size, group, node.meta["val"]))
        else:
            for part in [u for u in node.users if u.target is operator.getitem]:
                block = blocks[part.args[1]]
                part.replace_all_uses_with(_summed(graph, part, block, size, group, part.meta["val"]))
                graph.erase_node(part)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def _summed(graph: fx.Graph, before: fx.Node, block: fx.Node, size: int, group: str, val: torch.Tensor) -> fx.Node:
    """This rank's ``block`` at its rows among ``size`` blocks of zeros (``val``: the gathered value), all-reduced
    over ``group``: the all-gather's value, waited by the gather's own waits. Padded, not concatenated with
    ``zeros_like``, which Inductor refuses after decomposition."""
    rank = dist.get_rank(resolve_process_group(group))
    rows = val.shape[0] // size
    pad = [0, 0] * (val.dim() - 1) + [rank * rows, (size - 1 - rank) * rows]  # the last pair pads dim 0
    with graph.inserting_before(before):
        padded = graph.call_function(aten.constant_pad_nd.default, (block, pad, 0))
        reduced = graph.call_function(c10d.all_reduce.default, (padded, "sum", group))
    padded.meta["val"] = reduced.meta["val"] = val
    return reduced


def on_gloo(group_name: str) -> bool:
    """Whether the process group named ``group_name`` runs on gloo (see [Note: no all-gather on gloo])."""
    return dist.get_backend(resolve_process_group(group_name)) == "gloo"
