"""The planner's figures for its own plan against the same plan's compiled graphs, at Llama-3-8B's width.

    python benchmarks/plan_against_graphs.py        # about 4 minutes on 2 cores; no GPU, nothing is trained

Hugging Face's Llama at Llama-3-8B's sizes, cut to a few layers (examples/llama3_on_paper.py, built on meta, one
2,048-token row a rank), is planned by ``dpar.plan`` on a fixed mesh (h100 preset, 80 GB, or a budget that makes
it recompute activations); then ``dpar.explain``
compiles that plan's step for every rank of the mesh (fake process group) and counts it on the graphs with the
same device description: memory at the step's peak, compute, communication, the simulated step and what of the
communication it leaves exposed. A ratio is the graphs' figure over the search's (1: they agree): how far the
search's own prices, which rank the plans, are from what the chosen plan's graphs hold and run. ``dpar plan`` reports
the graphs' count (``priced_on_graphs``: a tp plan on copies cut to two and three blocks, extrapolated): the last
column is that count over the whole model's. Writes benchmarks/results/plan_against_graphs.json (its
page: ``python benchmarks/results_pages.py``) and prints the table.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))
from harness import revision  # noqa: E402
from llama3_on_paper import llama3  # noqa: E402

import dpar  # noqa: E402
import torch  # noqa: E402
from dpar.planning import CostBreakdown, global_batch, priced_on_graphs  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
CASES = (  # layers, mesh, the mesh's roles, the memory budget (GB a rank)
    (2, (8, 8), ("dp", "tp"), 80.0),
    (8, (8, 8), ("dp", "tp"), 80.0),
    (4, (8, 8), ("dp", "tp"), 4.2),  # a budget that makes the search recompute
    (8, (64,), ("dp",), 80.0),
)
FIGURES = ("memory_gb", "compute_ms", "comm_ms", "exposed_ms", "step_ms")


def _figures(c: CostBreakdown) -> dict[str, float]:
    """A plan's cost in the table's units."""
    return dict(memory_gb=c.memory_bytes_per_rank / 1e9, compute_ms=(c.compute_s + c.recompute_s) * 1e3,
                comm_ms=c.comm_s * 1e3, exposed_ms=c.exposed_comm_s * 1e3, step_ms=c.step_s * 1e3)


def case(layers: int, mesh: tuple[int, ...], roles: tuple[str, ...], budget_gb: float) -> dict:
    model, rank_inputs = llama3("8b", rows=1, num_hidden_layers=layers)
    world = math.prod(mesh)
    start = time.perf_counter()
    plan = dpar.plan(model, global_batch(rank_inputs, world), mesh_shape=mesh, mesh_dim_names=roles,
                     memory_budget_gb=budget_gb)
    planned_s = time.perf_counter() - start
    search = _figures(plan.cost)
    start = time.perf_counter()
    report = dpar.explain(model, rank_inputs, plan=plan, device="h100")
    counted_s = time.perf_counter() - start
    t = report.timeline
    graphs = dict(memory_gb=report.memory.total / 1e9, compute_ms=t.compute_time * 1e3, comm_ms=t.comm_time * 1e3,
                  exposed_ms=t.exposed_comm * 1e3, step_ms=t.step_time * 1e3)
    start = time.perf_counter()
    dpar_plan = _figures(priced_on_graphs(plan, model, global_batch(rank_inputs, world), "h100").cost)  # dpar plan's own
    priced_s = time.perf_counter() - start
    return {
        "model": f"Llama-3-8B, {layers} layers", "mesh": " x ".join(f"{n} {r}" for n, r in zip(mesh, roles)),
        "budget_gb": budget_gb,
        "plan": plan.strategy + (" SP" if plan.sequence_parallel else "") + f", {plan.activations}",
        "search": search, "graphs": graphs, "ratio": {k: graphs[k] / search[k] for k in FIGURES},
        "planned_s": planned_s, "counted_s": counted_s,
        "dpar_plan": dpar_plan, "dpar_plan_over_graphs": {k: dpar_plan[k] / graphs[k] for k in FIGURES},
        "dpar_plan_s": priced_s,
    }


def table(rows: list[dict]) -> str:
    lines = ["| model | mesh | plan | " + " | ".join(f"{k} (search / graphs, ratio)" for k in FIGURES)
             + " | dpar plan's count / graphs (memory, step; its seconds against the whole count's) |",
             "|---|---|---|" + "---|" * (len(FIGURES) + 1)]
    for r in rows:
        cells = [f"{r['search'][k]:.3g} / {r['graphs'][k]:.3g}, {r['ratio'][k]:.2f}" for k in FIGURES]
        own = r["dpar_plan_over_graphs"]
        cells.append(f"{own['memory_gb']:.6f}, {own['step_ms']:.6f} ({r['dpar_plan_s']:.0f} s / {r['counted_s']:.0f} s)")
        lines.append(f"| {r['model']} | {r['mesh']} | {r['plan']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    rows = [case(*c) for c in CASES]
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"revision": revision(), "torch": torch.__version__, "device": "h100 preset (modelled), counted on 2 CPU cores",
              "rows": rows}
    (RESULTS / "plan_against_graphs.json").write_text(json.dumps(record, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
