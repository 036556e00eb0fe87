"""``plan_pipeline`` / ``dpar plan --pipeline``: the pipeline degree under a memory budget, worked by hand.

``pipeline_models.Stack`` (4 x Linear(16, 16), no bias, MSE), a global batch of 8 rows on 4 ranks,
micro-batches of 2 rows (one rank's rows, pinned: the search over micro-batches is tested below), so a pipeline of ``pp`` stages runs
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
from distributed import run_ranks
from pipeline_models import FLOPS_ONLY, mse, stack

import dpar
from dpar.cli import main
from dpar.compiler.costs import DeviceSpec
from dpar import PipelineMemoryError
from dpar.planner import plan_pipeline
from dpar.planner.pipeline import PipelinePlan

MODELS = Path(__file__).resolve().parent / "pipeline_models.py"
F = 8.192e-6


def plan(budget_bytes: float | None, device=FLOPS_ONLY, rows: int = 8, **kwargs):
    model, batch = stack(rows=rows)
    kwargs = {"tp_max": 1, "dp_strategies": ("ddp",), "micro_batch_rows": 2, **kwargs}  # pp alone: the worked table above
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


def test_the_micro_batch_is_searched_down_from_one_ranks_rows():
    """[Note: searching the micro-batch]: 16 rows on 4 ranks, micro-batches of 4, 2 and 1 rows (a block's forward
    F_r = r / 2 x F). Without a budget pp=1 steps 24F with no bubble, which no smaller micro-batch beats: nothing more
    is captured. Under 12,000 bytes pp=1 (24,576 bytes at 4 rows) does not fit: at 4 rows pp=4 (10,240) steps
    (4 + 3) x 3 x 2F = 42F, at 2 rows pp=2 (11,264) (4 + 1) x 3 x 2F = 30F, at 1 row pp=2 (9,728) (8 + 1) x 3 x F = 27F,
    the choice. Under 8,000 bytes nothing fits at 4 rows; pp=4 at one row (5,632 bytes) does."""
    def searched(budget: float | None) -> PipelinePlan:
        return plan(budget, rows=16, micro_batch_rows=None)

    free = searched(None)
    assert free.micro_batch_sizes == (4,) and (free.pp, free.micro_batch_rows, free.choice.step_s) == (
        1, 4, pytest.approx(24 * F))
    tight = searched(12_000)
    assert tight.micro_batch_sizes == (4, 2, 1)
    each = [plan(12_000, rows=16, micro_batch_rows=r).choice for r in (4, 2, 1)]
    assert [(c.pp, c.micro_batches, c.memory_bytes) for c in each] == [(4, 4, 10_240), (2, 4, 11_264), (2, 8, 9_728)]
    assert [c.step_s for c in each] == pytest.approx([42 * F, 30 * F, 27 * F])
    assert tight.choice == each[-1] and tight.micro_batch_rows == 1
    assert "micro-batches of 1 rows of 4/2/1 searched" in str(tight)
    small = searched(8_000)
    assert (small.pp, small.micro_batch_rows, small.choice.memory_bytes) == (4, 1, 5_632)
    with pytest.raises(PipelineMemoryError, match="least memory is pp=4"):
        plan(8_000, rows=16, micro_batch_rows=4)


def test_a_policy_is_weighed_against_the_policies_of_its_own_micro_batch():
    """A candidate recomputing is dropped where a policy recomputing less holds no more memory on the same layout;
    at another micro-batch it is another candidate: selective recomputation at 4 rows, holding more than keeping
    everything at one row, may still step faster (fewer micro-batches, less latency), so it stays."""
    from dpar.planner.pipeline import PipelineCandidate, _worth_recomputing

    def candidate(rows: int, policy: str, memory: int) -> PipelineCandidate:
        return PipelineCandidate(pp=2, tp=1, dp=2, dp_strategy="ddp", micro_batches=8 // rows, micro_batch_rows=rows,
                                 compute_s=1.0, tp_s=0.0, bubble=0.0, bubble_s=0.0, send_s=0.0, pipeline_s=1.0,
                                 dp_comm_s=0.0, step_s=1.0, state_bytes=0, activation_bytes=memory, fits=True,
                                 activations=policy)

    keep_1, selective_4 = candidate(1, "keep", 10), candidate(4, "selective", 12)
    assert _worth_recomputing([candidate(4, "keep", 16), selective_4, keep_1]) == [
        candidate(4, "keep", 16), selective_4, keep_1]
    assert _worth_recomputing([candidate(4, "keep", 12), selective_4]) == [candidate(4, "keep", 12)]


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


def test_one_plan_call_answers_for_placements_and_pipelines(capsys):
    """[Note: one answer over placements and pipelines]: on 16 H100s (two nodes of 8), the tests' 8-block GPT at
    1024 wide, 16 rows of 128 tokens: the plan is the pipeline search's best of two stages or more over 1F1B, ZB-H1 and
    ZBV (a zero-bubble one, faster than 1F1B's best), priced as the pipeline search prices it alone, faster than the
    placement search's best, which is a row beside it. The pipeline
    plan round-trips through JSON, parallelize refuses it by name, its printout says how to run it; placements alone
    and the cpu preset (host work unpriced) search no pipeline."""
    from functools import partial

    from planner_models import gpt

    from dpar.inspect.pipeline import block_collectives
    from dpar.planner.pipeline import SEARCHED_SCHEDULES, fastest
    from dpar.planner.plan import Plan

    model, inputs = gpt(n_layer=8, n_embd=1024, n_head=8, block=128, vocab=4096, batch=16)
    both = dpar.plan(model, inputs, mesh_shape=(16,))
    placements = dpar.plan(model, inputs, mesh_shape=(16,), pipelines=False)
    alone = plan_pipeline(model, inputs, world_size=16, memory_budget_gb=80, schedule=SEARCHED_SCHEDULES,
                          read_tp_collectives=partial(block_collectives, model, pipeline=dpar.pipeline))
    best = fastest([c for c in alone.candidates if c.pp > 1 and c.fits])
    one_f_one_b = fastest([c for c in alone.candidates if c.pp > 1 and c.fits and c.schedule == "1f1b"])
    assert best.schedule != "1f1b" and best.step_s < one_f_one_b.step_s  # a zero-bubble schedule, searched beside
    layout = both.pipeline
    assert layout is not None and (layout.pp, layout.tp, layout.dp, layout.dp_strategy, layout.schedule) == (
        best.pp, best.tp, best.dp, best.dp_strategy, best.schedule)
    assert both.mesh_shape == (best.dp, best.pp, best.tp) and both.mesh_dim_names == ("dp", "pp", "tp")
    assert layout.micro_batches == best.micro_batches and layout.micro_batches * layout.micro_batch_rows * best.dp == 16
    c = both.cost
    assert c.step_s == pytest.approx(best.step_s) and c.step_s < placements.cost.step_s
    assert c.compute_s + c.recompute_s + c.exposed_comm_s + c.bubble_s == pytest.approx(c.step_s)
    assert c.memory_bytes_per_rank == best.memory_bytes <= 80e9
    rows = {o.strategy: o for o in both.strategies}
    assert rows[f"placements: {placements.strategy}"].step_s == placements.cost.step_s
    assert best.micro_batch_rows == 1  # 16 rows on 16 ranks: one micro-batch size to search
    assert rows[f"pipeline {best.layout}, {best.micro_batches} micro-batches of 1 row"].step_s == best.step_s
    assert not any(o.strategy.startswith("pipeline") for o in placements.strategies) and placements.pipeline is None
    assert Plan.from_json(both.to_json()) == both
    with pytest.raises(dpar.OptionsError, match=r"is a pipeline \(pp=.*dpar\.pipeline\(model, loss_fn"):
        dpar.parallelize(model, plan=both)
    text = str(both)
    assert "run it with dpar.pipeline(model, loss_fn, example_inputs=..., plan=plan)" in text
    assert "pipeline bubble" in text
    on_cpu = dpar.plan(model, inputs, mesh_shape=(16,), device="cpu")
    assert on_cpu.pipeline is None and "the pipeline search" not in dict(on_cpu.seconds)
    assert main(["plan", f"{MODELS.parent}/planner_models.py:gpt", "--mesh-shape", "4", "--op-graph",
                 "--with-pipelines", "--device", "cpu"]) == 0
    assert "pipeline pp=" in capsys.readouterr().out
    assert main(["plan", f"{MODELS.parent}/planner_models.py:gpt", "--mesh-shape", "4", "--op-graph",
                 "--placements-only"]) == 0
    assert "pipeline pp=" not in capsys.readouterr().out


def _trained_as_planned(rank: int, world_size: int, plan, placements) -> tuple:  # noqa: ANN001
    from pipeline_training import ROWS_PER_RANK, batch, build, pipelined, token_loss

    layout = plan.pipeline
    x, y = batch(0, ROWS_PER_RANK * world_size)
    mine = (x.chunk(world_size)[rank], y.chunk(world_size)[rank])
    refused = []
    for kwargs in ({"plan": placements}, {"plan": plan, "stages": layout.stages + 2}):
        with pytest.raises(dpar.OptionsError) as error:
            dpar.pipeline(build("gpt", 4), token_loss, example_inputs=mine, **kwargs)
        refused.append(str(error.value))
    state, losses, _, _ = pipelined(rank, world_size, "gpt", 4, "adamw", layout.schedule, None, None,
                                    dp_strategy=layout.dp_strategy, plan=plan)
    return state, losses, refused


def test_a_pipeline_plan_trains_as_one_process():
    """``dpar.pipeline(..., plan=plan)`` runs the answer: on 4 gloo ranks, the tests' 4-block GPT planned with pipelines
    on the cpu preset (pp 2 x dp 2, ddp across, ZB-H1, 2 micro-batches of 4 rows), its mesh built from the plan;
    5 AdamW steps equal one process on the global batch. A placement plan, and a stage count beside the plan, are refused by name."""
    from pipeline_training import ROWS_PER_RANK, batch, build, one_process
    from training import max_abs_diff

    x, _ = batch(0, ROWS_PER_RANK * 4)
    plan = dpar.plan(build("gpt", 4), (x,), mesh_shape=(4,), device="cpu", pipelines=True)
    placements = dpar.plan(build("gpt", 4), (x,), mesh_shape=(4,), device="cpu")
    assert plan.pipeline is not None and placements.pipeline is None
    assert (plan.pipeline.pp, plan.pipeline.dp, plan.pipeline.schedule) == (2, 2, "zb_h1")
    reference, reference_losses = one_process("gpt", 4, "adamw", 4)
    results = run_ranks(_trained_as_planned, 4, plan, placements, timeout_s=300)
    assert max_abs_diff(reference, results[0][0]) < 1e-4
    for state, losses, refused in results:
        assert losses == pytest.approx(reference_losses, rel=1e-5)
        assert "is a placement plan (ddp)" in refused[0] and "dpar.parallelize(model, plan=plan)" in refused[0]
        assert f"stages={plan.pipeline.stages + 2!r} (the plan's {plan.pipeline.stages!r})" in refused[1]


def test_a_budget_neither_search_meets_names_both():
    """The placement search's smallest footprint and the pipeline search's, in one error, before anything runs."""
    from planner_models import gpt

    model, inputs = gpt(n_layer=8, n_embd=256, n_head=4, block=64, vocab=4096, batch=8)
    with pytest.raises(dpar.PlanMemoryError, match=r"no plan fits memory_budget_gb=0\.02: the smallest footprint .* "
                                                   r"Nor does a pipeline: no pipeline layout fits either: .*least memory"):
        dpar.plan(model, inputs, mesh_shape=(4,), memory_budget_gb=0.02)


def test_auto_applies_the_fastest_placements_and_warns_where_the_answer_is_a_pipeline():
    """``parallelize(strategy="auto")`` places parameters; where dpar.plan's answer on the same world is a pipeline
    (the 8-block GPT on 16 ranks of the h100 preset, as above), it says so and how to run it, and applies the plan
    searched without pipelines, which it records."""
    from fake_world import fake_world
    from planner_models import gpt

    model, (ids, targets) = gpt(n_layer=8, n_embd=1024, n_head=8, block=128, vocab=4096, batch=1)
    placements = dpar.plan(model, (ids.repeat(16, 1), targets.repeat(16, 1)), mesh_shape=(16,), pipelines=False)
    with fake_world(16):
        with pytest.warns(dpar.PipelineAdviceWarning, match=r"the fastest plan is a pipeline \(pp=.*dpar\.pipeline\("):
            dpar.parallelize(model, strategy="auto", example_inputs=(ids, targets))
        applied = dpar.core.plan.plan_of_model(model)
        assert applied is not None and applied.strategy.value == placements.strategy
