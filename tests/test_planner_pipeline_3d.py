"""``plan_pipeline`` over pp x tp x dp and ddp / fsdp, and zbv: worked by hand on ``pipeline_models.Stack``.

As in test_planner_pipeline.py: 4 x Linear(16, 16), a global batch of 8 rows, micro-batches of 2
rows; one block's forward F = 8.192 us on 1 GFLOP/s, backward 2F; a block hands on 1,024 bytes;
parameters 1,024 bytes a block, AdamW state 4 x that. Under tp each stage's compute, state and
activations are divided by tp, and each block adds two all-reduces of its 1,024-byte activation to
the forward and two to the backward, on the intra-node link.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from machine_speed import budget_s
from pipeline_models import FLOPS_ONLY, mse, stack

from dpar.cli import main
from dpar.compiler.costs import DeviceSpec
from dpar.planner import plan_pipeline

F = 8.192e-6
# 1 GFLOP/s, 1 GB/s between nodes (1 us a ring step), 10 GB/s inside one (0.1 us a step)
LINKS = DeviceSpec("links", 1e9, 1e9, float("inf"), alpha=1e-6, link_bandwidth=1e9, intra_alpha=1e-7,
                   intra_link_bandwidth=1e10)


def plan(budget_bytes: float | None, world_size: int = 4, device=FLOPS_ONLY, **kwargs):
    model, batch = stack(rows=8)
    return plan_pipeline(model, batch, world_size=world_size, loss_fn=mse, device=device, micro_batch_rows=2,
                         memory_budget_gb=None if budget_bytes is None else budget_bytes / 1e9, **kwargs)


def by_layout(p):
    return {(c.pp, c.tp, c.dp_strategy): c for c in p.candidates if c.activations == "keep"}


def test_tp_divides_compute_state_and_activations_and_adds_its_all_reduces():
    got = by_layout(plan(None, device=LINKS))
    c = got[1, 2, "ddp"]  # one stage of 4 blocks, 2 pipelines of m = 8 / (2 x 2) = 2 micro-batches
    assert (c.dp, c.micro_batches) == (2, 2)
    per_direction = 4 * 2 * (2 * 1e-7 + 1024 / 1e10)  # 4 blocks x 2 ring all-reduces over 2 ranks, intra-node
    assert c.tp_s == pytest.approx(2 * 2 * per_direction)  # m x (F's + B's)
    assert c.compute_s == pytest.approx(2 * (3 * 4 * F / 2 + 2 * per_direction))
    assert c.pipeline_s == pytest.approx(c.compute_s)  # one stage: no bubble
    assert c.dp_comm_s == pytest.approx(2 * 1e-6 + 2048 / 1e9)  # all-reduce of 4,096 / tp gradient bytes over dp=2
    assert c.step_s == pytest.approx(c.pipeline_s + c.dp_comm_s)
    assert (c.state_bytes, c.activation_bytes) == (4096 / 2 * 4, 4096 / 2)
    fsdp = got[1, 2, "fsdp"]  # all-gather + reduce-scatter: the same ring bytes and steps as the all-reduce
    assert fsdp.dp_comm_s == pytest.approx(c.dp_comm_s)
    assert fsdp.state_bytes == 2048 * 4 / 2 + 2 * 2048  # shards / dp, plus gathered parameters and gradients


def test_a_loose_budget_on_one_node_keeps_tp_1_when_its_collectives_cost_more_than_they_save():
    p = plan(1e9, device="h100")  # Stack's compute is nanoseconds, an NVLink all-reduce microseconds
    assert p.tp == 1 and p.dp_strategy == "ddp"
    assert {c.tp for c in p.candidates} == {1, 2, 4}
    assert all(c.step_s > p.choice.step_s for c in p.candidates if c.tp > 1)


def test_a_tight_budget_forces_tp():
    # Least memory with tp=1 is pp=4's 7,168 bytes; pp=1 x tp=4: 4,096 / 4 x 4 state + 4,096 / 4 activations
    p = plan(6_000)
    assert p.tp > 1 and p.choice.memory_bytes <= 6_000
    assert not any(c.fits for c in p.candidates if c.tp == 1)
    assert by_layout(p)[1, 4, "ddp"].memory_bytes == 4096 + 1024
    assert "('dp', 'pp', 'tp') mesh" in str(p)


def test_a_budget_between_ddp_and_fsdp_picks_fsdp():
    # pp=1 x dp=4: ddp holds 16,384 + 4,096; fsdp 16,384 / 4 + 2 x 4,096 + 4,096 = 16,384 and runs 12F
    # (free links) against pp=2's 18F; with room for ddp the tie goes to ddp
    assert plan(17_000, tp_max=1).choice.layout == "pp=1 x tp=1 x dp=4 (fsdp)"
    assert plan(1e9, tp_max=1).choice.layout == "pp=1 x tp=1 x dp=4 (ddp)"
    assert plan(17_000, tp_max=1, dp_strategies=("ddp",)).choice.layout == "pp=2 x tp=1 x dp=2 (ddp)"


def test_cli_prints_the_3d_table_and_says_tp_is_on_paper(capsys):
    models = Path(__file__).resolve().parent / "pipeline_models.py"
    code = main(["plan", f"{models}:stack", "--mesh-shape", "4", "--per-rank", "--pipeline", "--memory-budget-gb",
                 "0.000006", "--micro-batch-rows", "2", "--loss", f"{models}:mse"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert {(r[1], r[3]) for r in rows} == {("1", "ddp"), ("1", "fsdp"), ("2", "ddp"), ("2", "fsdp"), ("4", "ddp")}
    chosen = [r for r in rows if r[-1] == "chosen"]
    assert len(chosen) == 1 and int(chosen[0][1]) > 1 and "('dp', 'pp', 'tp') mesh" in out
    assert main(["plan", f"{models}:stack", "--mesh-shape", "4", "--per-rank", "--pipeline", "--memory-budget-gb",
                 "0.000006", "--micro-batch-rows", "2", "--loss", f"{models}:mse", "--tp-max", "1"]) == 2
    assert "the least memory is pp=4 x tp=1 x dp=1 (ddp)" in capsys.readouterr().out


def test_zbv_needs_two_blocks_per_rank_and_prices_the_v():
    assert {c.pp for c in plan(None, tp_max=1).candidates} == {1, 2, 4}
    p = plan(None, schedule="zbv", tp_max=1, dp_strategies=("ddp",))
    assert {c.pp for c in p.candidates} == {1, 2}  # 4 ranks x 2 stages would need 8 blocks
    c = by_layout(p)[2, 1, "ddp"]  # 4 one-block chunks in a V on 2 ranks, m = 2
    # a rank computes 2 chunks x m x (F + I + W) = 12F; idle max(p - 1, 4p - 2 - 2m) = 2F ([Note: the ZBV bubble])
    assert c.compute_s == pytest.approx(12 * F)
    assert c.pipeline_s == pytest.approx(14 * F)
    assert c.bubble == pytest.approx(2 / 14)
    # rank 0 holds stages 0 and 3 (two blocks' state); p = 2 micro-batches of each stage's activations
    assert c.state_bytes == 2 * 1024 * 4
    assert c.activation_bytes == 2 * (0 + 2048)


def _llama(heads: int, kv_heads: int, layers: int = 2):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from llama3_on_paper import llama3, model_loss

    model, (ids,) = llama3("8b", seq=16, hidden_size=heads * 8, intermediate_size=64, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads)
    ids = ids.expand(8, 16)
    return model, (ids, ids), model_loss


def test_a_tp_that_does_not_divide_the_heads_is_never_offered():
    model, batch, loss = _llama(heads=6, kv_heads=2)
    p = plan_pipeline(model, batch, world_size=8, loss_fn=loss, memory_budget_gb=None)
    assert {c.tp for c in p.candidates} == {1, 2}  # 4 and 8 divide the world, not the 6 heads
    model, batch, loss = _llama(heads=8, kv_heads=4)
    p = plan_pipeline(model, batch, world_size=8, loss_fn=loss, memory_budget_gb=None)
    assert {c.tp for c in p.candidates} == {1, 2, 4}  # 8 does not divide the 4 key/value heads


def test_a_stage_of_several_blocks_costs_the_sum_of_its_blocks_less_the_batch_values_held_once():
    from dpar.compiler.pipeline_parallel.costs import price_stages, with_loss, micro_batch_of
    from dpar.compiler.costs import device_spec

    model, batch, loss = _llama(heads=4, kv_heads=2, layers=4)
    inputs, loss = with_loss(batch, loss)
    micro_batch = micro_batch_of(inputs, 1)
    _, direct = price_stages(model, loss, micro_batch, 2, device_spec("h100"))
    p = plan_pipeline(model, batch, world_size=8, loss_fn=loss, memory_budget_gb=None, tp_max=1,
                      dp_strategies=("ddp",), micro_batch_rows=1, optimizer="sgd")
    c = by_layout(p)[2, 1, "ddp"]  # 2 stages of 2 blocks, m = 8 / (4 x 1) = 2: rank 0 holds 2, rank 1 one
    assert direct[0].free_activation_bytes > 0  # RoPE's cos and sin
    fullest = max(((2 * direct[0].parameter_bytes, 2 * direct[0].activation_bytes),
                   (2 * direct[1].parameter_bytes, direct[1].activation_bytes)), key=sum)
    assert (c.state_bytes, c.activation_bytes) == fullest


def test_a_bounded_search_replays_fewer_layouts_for_the_same_choice():
    """``bounded=True`` (what ``dpar.plan`` runs): layouts replayed least bound first (the busiest rank's compute
    and dp collectives, which its step cannot undercut), stopping where none left could beat the fastest that fits.
    On 8 ranks, 32 rows, over the searched schedules, tp, ddp / fsdp and micro-batches of 4, 2 and 1 rows: the
    exhaustive search's choice, to the bit, under each budget, with fewer schedules replayed."""
    from dpar.planner.pipeline import SEARCHED_SCHEDULES

    model, batch = stack(rows=32)
    for budget in (None, 10e-6, 6e-6, 4e-6):
        kwargs = dict(world_size=8, loss_fn=mse, device=LINKS, memory_budget_gb=budget, schedule=SEARCHED_SCHEDULES,
                      min_pp=2)
        every = plan_pipeline(model, batch, **kwargs)
        bounded = plan_pipeline(model, batch, bounded=True, **kwargs)
        assert bounded.choice == every.choice and bounded.micro_batch_sizes == every.micro_batch_sizes == (4, 2, 1)
        assert bounded.unreplayed > 0 and len(bounded.candidates) < len(every.candidates)
        assert all(c.pp > 1 for c in every.candidates) and every.unreplayed == 0
        assert f"{bounded.unreplayed} more layouts not replayed" in str(bounded)


def test_llama3_70b_at_512_ranks_fits_80_gb_with_tp_in_under_a_minute():
    """Llama-3-70B in bf16 on meta, 512 rows of 4096 tokens, 80 GB per rank: no layout without tp
    fits keeping activations (1F1B holds a whole model's activations per micro-batch row on rank 0: 500 GB at
    tp=1); recomputing, some would, slower than the choice."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from llama3_on_paper import llama3, model_loss

    start = time.perf_counter()
    model, (ids,) = llama3("70b", seq=4096)
    model = model.to(torch.bfloat16)
    ids = ids.expand(512, 4096)
    p = plan_pipeline(model, (ids, ids), world_size=512, loss_fn=model_loss, memory_budget_gb=80, device="h100")
    seconds = time.perf_counter() - start
    print(f"Llama-3-70B at 512 ranks: {p.choice.layout}, {p.choice.step_s * 1e3:.0f} ms/step, "
          f"{p.choice.memory_bytes / 1e9:.1f} GB per rank, planned in {seconds:.1f} s")
    assert p.tp > 1 and p.pp * p.tp * p.dp == 512
    assert p.choice.memory_bytes <= 80e9
    assert not any(c.fits for c in p.candidates if c.tp == 1 and c.activations == "keep")
    # recomputation is priced where it could win (and listed): it never does here, each is slower than the choice
    recomputing = [c for c in p.candidates if c.activations != "keep"]
    assert recomputing and all(c.step_s > p.choice.step_s for c in recomputing)
    assert seconds < budget_s(120.0)


def test_the_cli_plans_a_model_whose_layers_tp_cannot_split_without_reading_tp_graphs(capsys):
    """The example GPT's fused qkv is 3 parts: no tp degree is searched, so no tp graph is read (dpar.pipeline would
    refuse tp 2 there); the README's command."""
    code = main(["plan", "examples/gpt.py", "--mesh-shape", "8", "--per-rank", "--pipeline", "--memory-budget-gb",
                 "0.012", "--micro-batch-rows", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    # fsdp over 8 ranks recomputing selectively (35.3 ms) beats two stages keeping everything (36.8 ms)
    assert "pipeline plan: pp=1 x tp=1 x dp=8 (fsdp, selective recomputation)" in out
    assert "shape (8, 1), dp_strategy='fsdp', activation_checkpointing='selective'" in out
