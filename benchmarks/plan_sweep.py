"""What the planner picks for a GPT as batch, width and world size change, next to DDP, FSDP and TP alone.

    python benchmarks/plan_sweep.py        # about a minute; no GPU, nothing is trained

Every number is *modelled* (the planner's cost model on H100 defaults, see docs/planner.md),
not measured. The plan is ``dpar.plan``'s one answer over placements and pipelines (a pipeline plan's mesh is
(dp, pp, tp)). For each batch (sequences of 512 tokens) x hidden size x world size, the planner
plans examples/gpt.py's GPT (8 blocks, 64-wide heads, 32k vocabulary; built on the meta
device) under an 80 GB per-rank budget, on one node's mesh (8,) or on (nodes, 8) for 64 ranks,
so it may compose data and tensor parallel. DDP and FSDP alone are priced by the same model
on the same mesh (every dimension data parallel: hierarchical collectives, innermost first),
TP alone on the 1-D mesh (world,) (a 2-D mesh takes at most one tp dimension). A ratio is that strategy's step time over the planner's
(above 1: the planner is faster); "n/a" where a strategy does not apply (a batch dp cannot
split, heads tp cannot split), a trailing "!" where it would not fit the budget; "SP": the plan's tp axis runs
sequence parallel.
Writes benchmarks/results/plan_sweep.{json,md,png}.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

from dpar.planner.capture import build_op_graph  # noqa: E402
from dpar.compiler.costs import PRESETS  # noqa: E402
from dpar.planner.plan import Plan  # noqa: E402
from dpar.planner.strategies import evaluate_strategies  # noqa: E402
from dpar.planning import plan  # noqa: E402
from dpar.core.errors import OptionsError  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
BATCHES, HIDDENS, WORLDS = (8, 64, 512), (256, 1024, 4096), (8, 64)
BASELINES = ("ddp", "fsdp", "tp")
BUDGET_GB, SEQ, LAYERS, VOCAB = 80.0, 512, 8, 32768


def model_and_inputs(batch: int, hidden: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    config = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=hidden // 64, n_embd=hidden)
    with torch.device("meta"):
        model = GPT(config)
    ids = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    return model, (ids, ids.clone())


def sweep_point(batch: int, hidden: int, world: int) -> dict:
    model, inputs = model_and_inputs(batch, hidden)
    mesh = (world,) if world <= 8 else (world // 8, 8)
    row: dict = {"batch": batch, "hidden": hidden, "world": world, "mesh": list(mesh)}
    start = time.perf_counter()
    try:
        best = plan(model, inputs, mesh_shape=mesh, memory_budget_gb=BUDGET_GB)
    except OptionsError as error:
        return {**row, "plan": None, "error": str(error)}
    row.update(
        plan_s=time.perf_counter() - start, strategy=best.strategy + (" SP" if best.sequence_parallel else ""),
        data_parallel=best.data_parallel,
        roles=list(best.mesh_dim_names), plan_mesh=list(best.mesh_shape), step_s=best.cost.step_s, memory_gb=best.cost.memory_bytes_per_rank / 1e9,
    )
    graph = build_op_graph(model, inputs)
    on_mesh = evaluate_strategies(graph, mesh, PRESETS["h100"])
    flat = on_mesh if len(mesh) == 1 else evaluate_strategies(graph, (world,), PRESETS["h100"])
    alone = {"ddp": on_mesh["ddp"], "fsdp": on_mesh["fsdp"], "tp": flat["tp"]}
    for name in BASELINES:
        s = alone[name]
        row[name] = None if not isinstance(s, Plan) else {
            "step_s": s.cost.step_s, "ratio": s.cost.step_s / best.cost.step_s,
            "fits": s.cost.memory_bytes_per_rank <= BUDGET_GB * 1e9,
        }
    return row


def _cell(entry: dict | None) -> str:
    return "n/a" if entry is None else f"{entry['ratio']:.2f}{'' if entry['fits'] else '!'}"


def write_markdown(rows: list[dict], path: Path) -> None:
    lines = [
        "| world | hidden | batch | plan (roles, dp mode) | step (ms) | GB/rank | DDP / plan | FSDP / plan | TP / plan |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("plan", True) is None:
            lines.append(f"| {r['world']} | {r['hidden']} | {r['batch']} | no plan: {r['error'][:60]}... | | | | | |")
            continue
        roles = " × ".join(f"{n} {role}" for n, role in zip(r["plan_mesh"], r["roles"]))
        lines.append(
            f"| {r['world']} | {r['hidden']} | {r['batch']} | {r['strategy']} ({roles}, {r['data_parallel']}) "
            f"| {r['step_s'] * 1e3:.2f} | {r['memory_gb']:.1f} | " + " | ".join(_cell(r[n]) for n in BASELINES) + " |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORLDS), figsize=(12, 4.5), sharey=True)
    for ax, world in zip(axes, WORLDS):
        points = [r for r in rows if r["world"] == world and r.get("plan", True) is not None]
        labels = [f"h{r['hidden']}\nb{r['batch']}\n{r['strategy']}" for r in points]
        width = 0.27
        for k, name in enumerate(BASELINES):
            ratios = [r[name]["ratio"] if r[name] else float("nan") for r in points]
            ax.bar([i + (k - 1) * width for i in range(len(points))], ratios, width, label=f"{name.upper()} / plan")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(points)), labels, fontsize=6)
        ax.set_title(f"{world} ranks (plan on mesh {points[0]['mesh'] if points else ''})")
    axes[0].set_ylabel("modelled step time / planner's (log)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Planner vs one strategy alone (GPT, 8 blocks, H100 cost model; no bar: does not apply)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    rows = [sweep_point(b, h, w) for w, h, b in itertools.product(WORLDS, HIDDENS, BATCHES)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "plan_sweep.json").write_text(json.dumps({"budget_gb": BUDGET_GB, "rows": rows}, indent=1) + "\n")
    write_markdown(rows, RESULTS / "plan_sweep.md")
    write_plot(rows, RESULTS / "plan_sweep.png")
    print((RESULTS / "plan_sweep.md").read_text())


if __name__ == "__main__":
    main()
