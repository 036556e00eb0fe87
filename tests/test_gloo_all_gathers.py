"""On gloo, no all-gather runs ([Note: no all-gather on gloo] in compiler/passes/gloo_all_gathers.py): gloo's
all-gather corrupts the heap (benchmarks/gloo_all_gather_race.py), so each runs as an all-reduce of the
rank's block among zeros.

On 2 gloo ranks, one launch: the rewrite on a graph of its own (plain and coalesced gathers, against gloo's own
all-gather, bit for bit), then the example GPT under tp: the collectives gloo ran in a profiled step (all-reduces, no
all-gather) beside the graphs recorded as planned (with their all-gathers), and its parameters against one
process on the whole batch.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.distributed as dist
import torch.fx as fx

from distributed import run_ranks
from tensor_parallel_training import single_process, train_parallel
from training import STEPS, TOLERANCE, Case, max_abs_diff

c10d = torch.ops._c10d_functional


def _gather_graph(group: str, x: torch.Tensor, y: torch.Tensor) -> fx.GraphModule:
    """A plain and a coalesced gather of ``x`` and ``y``, each gathered value in its node's meta (as after the passes)."""
    graph = fx.Graph()
    inputs = graph.placeholder("x"), graph.placeholder("y")
    gather = graph.call_function(c10d.all_gather_into_tensor.default, (inputs[0], 2, group))
    both = graph.call_function(c10d.all_gather_into_tensor_coalesced.default, (list(inputs), 2, group))
    parts = [graph.call_function(operator.getitem, (both, i)) for i in range(2)]
    for node, t in zip((gather, *parts), (x, x, y)):
        node.meta["val"] = torch.cat([t, t])
    graph.output(tuple(graph.call_function(c10d.wait_tensor.default, (n,)) for n in (gather, *parts)))
    return fx.GraphModule(torch.nn.Module(), graph)


def _rewrite(rank: int) -> dict[str, object]:
    from dpar.compiler.passes.gloo_all_gathers import as_run_on_gloo

    group = dist.group.WORLD.group_name
    x = torch.tensor([[-0.0, 1.5, float("inf")], [float("nan"), 3.0, -2.0]]) + rank
    y = torch.arange(4, dtype=torch.int64).view(2, 2) * (rank + 1)
    planned = _gather_graph(group, x, y)
    run = as_run_on_gloo(planned)
    got = run(x, y)
    expected = []
    for t in (x, x, y):
        blocks = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(blocks, t)
        expected.append(torch.cat(blocks))
    gathers_left = sum("all_gather" in str(n.target) for n in run.graph.nodes)
    return {
        "same": [torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(a.isnan(), b.isnan())
                 for a, b in zip(got, expected)],
        "gathers_left": gathers_left,
        "all_reduces": sum(n.target is c10d.all_reduce.default for n in run.graph.nodes),
        "planned_kept": sum("all_gather" in str(n.target) for n in planned.graph.nodes),
    }


def _train(rank: int, world_size: int) -> dict[str, object]:
    """The GPT under tp, its last step (compiled graphs only, nothing compiling) profiled."""
    from torch.profiler import ProfilerActivity, profile

    from dpar.compiler import registry

    profiled = profile(activities=[ProfilerActivity.CPU])
    with registry.recording() as graphs:
        trained = train_parallel(rank, world_size, Case("gpt", "adamw"), "tp",
                                 step_context=lambda step: profiled if step == STEPS - 1 else contextlib.nullcontext())
    ran = [e.name for e in profiled.events()]
    return {
        "rewritten": _rewrite(rank),
        "recorded_gathers": sum(c.kind == "all_gather" for g in graphs for c in g.collectives),
        "gloo_gathers": ran.count("gloo:all_gather"),
        "gloo_all_reduces": ran.count("gloo:all_reduce"),
        "trained": trained,
    }


def test_tensor_parallel_on_gloo_runs_its_gathers_as_all_reduces_and_matches_one_process() -> None:
    results = run_ranks(_train, 2)
    for rank, result in enumerate(results):
        rewritten = result["rewritten"]
        assert rewritten["same"] == [True, True, True], rewritten  # the gather's values, inf, nan and ints alike
        assert rewritten["gathers_left"] == 0 and rewritten["all_reduces"] == 3, rewritten
        assert rewritten["planned_kept"] == 2, rewritten  # the rewrite works on a copy
        assert result["recorded_gathers"] >= 2, result  # the graphs as planned, with the attention's gathers
        assert result["gloo_gathers"] == 0, f"rank {rank}: gloo ran {result['gloo_gathers']} all-gathers in a step"
        assert result["gloo_all_reduces"] >= result["recorded_gathers"], result
    assert max_abs_diff(results[0]["trained"], single_process(Case("gpt", "adamw"))) <= TOLERANCE["adamw"]
