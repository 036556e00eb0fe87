"""``plan_pipeline`` / ``dpar plan --pipeline``: the pipeline degree under a memory budget, worked by hand.

``pipeline_models.Stack`` (4 x Linear(16, 16), no bias, MSE), a global batch of 8 rows on 4 ranks,
micro-batches of 2 rows (the default: rows / world), so a pipeline of ``pp`` stages runs
``m = 8 / (dp x 2) = pp`` micro-batches. One block's forward is F = 8.192 us on ``FLOPS_ONLY``;
backward 2F. Per block: AdamW state 4 x 1,024 bytes; each block but the first saves its 1,024-byte
input, the loss its 1,024-byte difference.

| pp | dp | m | span (1F1B)                 | state/rank | activations, fullest rank      | memory |
|----|----|---|-----------------------------|------------|--------------------------------|--------|
| 1  | 4  | 1 | 1 x 3 x 4F = 12F            | 16,384     | 3 inputs + loss = 4,096        | 20,480 |
| 2  | 2  | 2 | (2+1) x 3 x 2F = 18F        | 8,192      | rank 1: 1 x (2 inputs + loss)  | 11,264 |
| 4  | 1  | 4 | (4+3) x 3 x F = 21F         | 4,096      | rank 1: 3 x 1,024              | 7,168  |
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pipeline_models import FLOPS_ONLY, mse, stack

import dpar
from dpar.cli import main
from dpar.compiler.costs import DeviceSpec
from dpar import PipelineMemoryError
from dpar.planner import plan_pipeline

MODELS = Path(__file__).resolve().parent / "pipeline_models.py"
F = 8.192e-6


def plan(budget_bytes: float | None, device=FLOPS_ONLY, **kwargs):
    model, batch = stack(rows=8)
    kwargs = {"tp_max": 1, "dp_strategies": ("ddp",), **kwargs}  # pp alone: the worked table above
    return plan_pipeline(model, batch, world_size=4, loss_fn=mse, device=device,
                         memory_budget_gb=None if budget_bytes is None else budget_bytes / 1e9, **kwargs)


def test_every_candidate_prices_compute_bubble_and_memory_as_worked_by_hand():
    p = plan(None)
    got = {c.pp: c for c in p.candidates}
    assert sorted(got) == [1, 2, 4]
    assert [(got[k].dp, got[k].micro_batches) for k in (1, 2, 4)] == [(4, 1), (2, 2), (1, 4)]
    assert [got[k].compute_s for k in (1, 2, 4)] == pytest.approx([12 * F] * 3)
    assert [got[k].bubble for k in (1, 2, 4)] == pytest.approx([0, 1 / 3, 3 / 7])
    assert [got[k].pipeline_s for k in (1, 2, 4)] == pytest.approx([12 * F, 18 * F, 21 * F])
    for c in p.candidates:  # equal stages, free sends: the span is compute plus the formula's bubble
        assert c.pipeline_s == pytest.approx(c.compute_s + c.bubble_s)
    assert [got[k].state_bytes for k in (1, 2, 4)] == [16384, 8192, 4096]
    assert [got[k].activation_bytes for k in (1, 2, 4)] == [4096, 3072, 3072]
    assert [got[k].memory_bytes for k in (1, 2, 4)] == [20480, 11264, 7168]


def test_a_budget_that_fits_the_whole_model_picks_no_pipeline():
    p = plan(1e9)
    assert (p.pp, p.dp) == (1, 4)
    assert all(c.fits for c in p.candidates)
    assert "pp=1 x tp=1 x dp=4 (ddp) on 4 ranks" in str(p) and "<- chosen" in str(p)


def test_a_budget_that_fits_half_the_model_picks_two_stages():
    p = plan(15_000)  # below pp=1's 20,480 bytes, above pp=2's 11,264
    assert (p.pp, p.dp) == (2, 2)  # 18F beats pp=4's 21F
    assert [c.fits for c in p.candidates] == [False, True, True]


def test_zero_bubble_schedule_changes_the_spans_and_the_memory_held():
    p = plan(None, schedule="zb_h1")
    got = {c.pp: c for c in p.candidates}
    # 3m + p - 1 units of F per stage, over max(3m + p - 1, 2m + 2p - 1): m = p here
    assert [got[k].pipeline_s for k in (1, 2, 4)] == pytest.approx([12 * F, (3 * 2 + 1) * 2 * F, (3 * 4 + 3) * F])
    assert got[4].activation_bytes == 4 * 2048  # the last rank holds p = 4 micro-batches (1F1B: 1) of 2,048 bytes


def test_an_impossible_budget_raises_naming_the_least_footprint_and_the_fix():
    with pytest.raises(PipelineMemoryError, match=r"least memory is pp=4 x tp=1 x dp=1 \(ddp\) with 7.168e-06 GB.*at least 7.168e-06") as error:
        plan(5_000)
    assert isinstance(error.value, dpar.OptionsError)


def test_data_parallel_all_reduce_is_the_ring_over_dp_of_a_stage_of_gradients():
    link = DeviceSpec("link", 1e9, 1e9, float("inf"), alpha=1e-6, link_bandwidth=1e9)
    got = {c.pp: c for c in plan(None, device=link).candidates}
    # pp=1: all 4,096 gradient bytes over dp=4: 2(N-1) alpha + 2(N-1)/N B beta; pp=4 has dp=1
    assert got[1].dp_comm_s == pytest.approx(6e-6 + 1.5 * 4096e-9)
    assert got[2].dp_comm_s == pytest.approx(2e-6 + 2048e-9)
    assert got[4].dp_comm_s == 0.0
    assert got[2].send_s == pytest.approx(1e-6 + 1024e-9)
    assert got[2].step_s == pytest.approx(got[2].pipeline_s + got[2].dp_comm_s)


def test_bad_arguments_name_the_fix():
    with pytest.raises(dpar.OptionsError, match="not one of"):
        plan(None, schedule="interleaved_1f1b")
    with pytest.raises(dpar.OptionsError, match="does not divide the global batch of 8 rows"):
        plan(None, micro_batch_rows=3)


def test_cli_plan_pipeline_prints_every_candidate_and_the_choice(capsys):
    code = main(["plan", f"{MODELS}:stack", "--mesh-shape", "4", "--per-rank", "--pipeline",
                 "--memory-budget-gb", "0.000015", "--micro-batch-rows", "2", "--loss", f"{MODELS}:mse",
                 "--tp-max", "1", "--dp-strategy", "ddp"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[-1] if r[-1] in ("yes", "no") else r[-3]) for r in rows] == [("1", "no"), ("2", "yes"), ("4", "yes")]
    assert "pipeline plan: pp=" in out and "pp=1 x" not in out
    assert main(["plan", f"{MODELS}:stack", "--mesh-shape", "4", "--pipeline", "--memory-budget-gb", "1e-9",
                 "--loss", f"{MODELS}:mse"]) == 2
    assert "Raise memory_budget_gb" in capsys.readouterr().out


def test_one_plan_call_searches_placements_and_pipelines_and_says_which_is_faster(capsys):
    """``dpar.plan(..., pipelines=True)``: the pipeline search runs on the same ranks, batch and device (a model that
    returns its loss priced as that loss); its choice is one more row of the side-by-side table, priced as
    ``plan_pipeline`` prices it alone, and the plan says a pipeline is faster exactly when it is. The CLI's
    ``--with-pipelines`` prints the row."""
    from planner_models import gpt

    model, inputs = gpt(n_layer=4, n_embd=64, n_head=4, block=64, vocab=256, batch=8)
    both = dpar.plan(model, inputs, mesh_shape=(4,), pipelines=True)
    alone = plan_pipeline(model, inputs, world_size=4, memory_budget_gb=None)
    row = next(o for o in both.strategies if o.strategy.startswith("pipeline "))
    assert row.strategy == f"pipeline {alone.choice.layout}" and row.step_s == pytest.approx(alone.choice.step_s)
    assert bool(both.faster_pipeline) == (row.step_s < both.cost.step_s)
    assert [phase for phase, _ in both.seconds][-1] == "the pipeline search"
    assert dpar.plan(model, inputs, mesh_shape=(4,)).strategies == both.strategies[:-1]  # the rest as without
    assert main(["plan", f"{MODELS.parent}/planner_models.py:gpt", "--mesh-shape", "4", "--op-graph",
                 "--with-pipelines"]) == 0
    assert "pipeline pp=" in capsys.readouterr().out
