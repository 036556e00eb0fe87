"""On gloo, an all-gather never runs beside another collective ([Note: an all-gather alone on gloo] in
compiler/passes/gloo_all_gathers.py): gloo corrupts the heap when one does (benchmarks/gloo_all_gather_race.py).

The pass on a graph of its own; then the example GPT under tp on 2 gloo ranks (whose forward had 2
all-gathers in flight at once), the collectives in flight beside an all-gather counted in the compiled graphs'
order, and the parameters against one process on the whole batch.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from distributed import run_ranks
from tensor_parallel_training import single_process, train_parallel
from training import TOLERANCE, Case, max_abs_diff

c10d = torch.ops._c10d_functional


def test_each_all_gather_runs_alone_and_the_other_collectives_keep_their_overlap() -> None:
    from dpar.compiler.passes.gloo_all_gathers import isolate_all_gathers

    graph = fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "g"))
    second = graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "g"))
    reduced = graph.call_function(c10d.all_reduce.default, (x, "sum", "g"))
    both = graph.call_function(c10d.all_gather_into_tensor_coalesced.default, ([x, x], 2, "g"))
    later = graph.call_function(c10d.all_reduce.default, (x, "sum", "g"))
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))
    waits = [graph.call_function(c10d.wait_tensor.default, (n,)) for n in (first, second, reduced)]
    parts = [graph.call_function(operator.getitem, (both, i)) for i in range(2)]
    waits += [graph.call_function(c10d.wait_tensor.default, (p,)) for p in parts]
    waits.append(graph.call_function(c10d.wait_tensor.default, (later,)))
    graph.output((*waits, y))
    gm = isolate_all_gathers(fx.GraphModule(torch.nn.Module(), graph))
    expected = [
        x, first, waits[0], second, waits[1], reduced, waits[2],  # the all-reduce is waited before the next gather
        both, parts[0], waits[3], parts[1], waits[4], later, y, waits[5],  # the last all-reduce still overlaps mul
    ]
    assert list(gm.graph.nodes)[:-1] == expected, [n.name for n in gm.graph.nodes]


def _crowding(gm: fx.GraphModule) -> int:
    """The most collectives in flight beside an all-gather, at any point of the graph's order."""
    in_flight: set[fx.Node] = set()
    most = 0
    for node in gm.graph.nodes:
        if node.target is c10d.wait_tensor.default:
            in_flight.discard(node.args[0])
        elif getattr(node.target, "namespace", None) == "_c10d_functional":
            in_flight.add(node)
        if any(n.target is c10d.all_gather_into_tensor.default for n in in_flight):
            most = max(most, len(in_flight) - 1)
    return most


def _train(rank: int, world_size: int) -> dict[str, object]:
    from dpar.compiler import registry

    with registry.recording() as graphs:
        trained = train_parallel(rank, world_size, Case("gpt", "adamw"), "tp")
    gathers = sum(c.kind == "all_gather" for g in graphs for c in g.collectives)
    return {"crowding": max(_crowding(g.graph) for g in graphs), "gathers": gathers, "trained": trained}


def test_tensor_parallel_on_gloo_runs_each_all_gather_alone_and_matches_one_process() -> None:
    """The GPT's forward under tp issues its attention's gathers together (2 in flight on 2 ranks before)."""
    results = run_ranks(_train, 2)
    for rank, result in enumerate(results):
        assert result["gathers"] >= 2, result
        assert result["crowding"] == 0, f"rank {rank}: {result['crowding']} collectives in flight beside an all-gather"
    assert max_abs_diff(results[0]["trained"], single_process(Case("gpt", "adamw"))) <= TOLERANCE["adamw"]
