"""``dpar plan TARGET --mesh-shape ...`` prints the plan and writes it as JSON."""

from __future__ import annotations

import re
from pathlib import Path

from dpar.cli import main
from dpar.planning import Plan

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")


def test_plan_command_prints_every_parameter_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", GPT, "--mesh-shape", "2,4", "--memory-budget-gb", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = Plan.from_json(out.read_text())
    assert plan.mesh_shape == (2, 4)
    assert all(p.name in printed for p in plan.parameters)
    assert "modelled cost per step" in printed and f"json: {out}" in printed
    assert "data split over: " in printed and f"global batch {plan.batch_size} rows" in printed
    # The time split: capture, the search, the named strategies priced beside it, the pipeline search (on a GPU
    # preset), the chosen plan priced on its compiled graphs (dpar plan's default; a plan with a tp or cp axis on
    # copies cut to a few blocks where the model has enough: api/graph_pricing.py).
    assert plan.pipeline is None and plan.counted_on_graphs
    phases = ["capture", "search", "the named strategies priced", "the pipeline search", "pricing on the compiled graphs"]
    assert [phase for phase, _ in plan.seconds] == phases
    assert re.search(r"planned in [0-9.]+ s: " + ", ".join(f"{p} [0-9.]+ s" for p in phases), printed)
    assert "the named strategies on this mesh" in printed


def test_plan_command_takes_one_rank_slice_with_per_rank(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", GPT, "--mesh-shape", "8", "--per-rank", "--json", str(out)]) == 0
    plan = Plan.from_json(out.read_text())
    assert plan.batch_size == 8 * 8  # examples/gpt.py's default() hands one rank 8 rows
    assert f"global batch {plan.batch_size} rows" in capsys.readouterr().out


def test_plan_command_reports_a_budget_nothing_fits_and_fails(capsys):
    assert main(["plan", GPT, "--mesh-shape", "8", "--memory-budget-gb", "1e-6"]) == 2
    assert "no plan fits memory_budget_gb=1e-06" in capsys.readouterr().out


def test_plan_command_with_a_budget_prints_the_activation_policy_and_why(tmp_path, capsys):
    from test_planner_activations import U, _fsdp_footprint

    from dpar.core.plan import Recompute

    target = f"{Path(__file__).resolve().parent / 'test_planner_activations.py'}:residual"
    budget = (_fsdp_footprint(Recompute.SELECTIVE) + U / 2) / 1e9  # keep, or keep with three selective blocks, fits nowhere
    out = tmp_path / "plan.json"
    assert main(["plan", target, "--mesh-shape", "4", "--device", "cpu", "--memory-budget-gb", str(budget),
                 "--json", str(out), "--op-graph"]) == 0
    printed = capsys.readouterr().out
    plan = Plan.from_json(out.read_text())
    assert plan.activations.default is Recompute.SELECTIVE
    assert "activations: selective in every block" in printed
    assert "activation policies: the fastest plan that fits wins" in printed
    assert "memory per rank, keep vs chosen" in printed and "recompute added to the step" in printed
    # Counted on its compiled graphs (the default), that plan holds more than the budget: the answer is searched
    # again until its graphs fit ([Note: a plan that fits on its graphs]).
    assert main(["plan", target, "--mesh-shape", "4", "--device", "cpu", "--memory-budget-gb", str(budget),
                 "--json", str(out)]) == 0
    on_graphs = Plan.from_json(out.read_text())
    assert on_graphs.priced_on == "compiled graphs" and on_graphs.cost.memory_bytes_per_rank <= budget * 1e9
    assert on_graphs.activations != plan.activations
