"""``dpar.explain(strategy="pipeline")`` and ``dpar inspect --strategy pipeline``: one process, no process group.

Numbers are worked by hand on ``pipeline_models.Stack`` (one Linear(16, 16) per stage, micro-batches
of 2 rows x 8 x 16 fp32): a forward is 2 x 2 x 8 x 16 x 16 = 8,192 FLOPs = 8.192 us at 1 GFLOP/s,
a boundary carries 2 x 8 x 16 x 4 = 1,024 bytes.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from pipeline_models import FLOPS_ONLY, mse, stack

import dpar
from dpar.cli import main
from dpar.compiler.costs import DeviceSpec
from dpar.core.pipeline_program import Op
from dpar.inspect.pipeline import PipelineReport, explain_pipeline

MODELS = Path(__file__).resolve().parent / "pipeline_models.py"
F = 8.192e-6  # one stage's forward on one micro-batch


def report(schedule: str = "1f1b", device=FLOPS_ONLY, **kwargs) -> PipelineReport:
    model, inputs = stack(rows=4)  # 4 ranks x 4 rows = 16 rows = 8 micro-batches of 2
    return explain_pipeline(model, inputs, stages=4, micro_batches=8, schedule=schedule, loss_fn=mse, device=device,
                            **kwargs)


def test_stage_split_bytes_per_boundary_are_rows_x_seq_x_width_x_4_and_forward_time_is_the_roofline():
    r = report()
    assert r.micro_batch_rows == 2
    assert [c.blocks for c in r.stages] == [(f"blocks.{i}",) for i in range(4)]
    assert [c.parameter_bytes for c in r.stages] == [16 * 16 * 4] * 4
    assert [c.send_bytes for c in r.stages] == [2 * 8 * 16 * 4] * 3 + [0]
    assert [c.flops for c in r.stages] == [8192.0] * 3 + [8192.0 + 2 * 256 + 1]  # the loss: sub, pow, mean
    assert [c.forward_s for c in r.stages] == pytest.approx([F] * 4, rel=1e-12)  # elementwise: free here
    # Saved for the backward: each stage's received input (the weight gradient reads it), not
    # stage 0's batch; the last stage also the loss's difference (output - target).
    assert [c.activation_bytes for c in r.stages] == [0, 1024, 1024, 2048]


@pytest.mark.parametrize("schedule, span_in_forwards, bubble, in_flight", [
    ("gpipe", 33, 3 / 11, (8, 8, 8, 8)),  # (m + p - 1) x (F + 2F), bubble (p - 1) / (m + p - 1)
    ("1f1b", 33, 3 / 11, (4, 3, 2, 1)),  # same span, rank r holds p - r micro-batches
    ("zb_h1", 27, 3 / 27, (4, 4, 4, 4)),  # 3m + p - 1 with I = W = F, holding p everywhere
])
def test_simulated_bubble_per_rank_equals_the_formula_with_equal_stages(schedule, span_in_forwards, bubble, in_flight):
    r = report(schedule)
    assert r.timeline.span == pytest.approx(span_in_forwards * F, rel=1e-12)
    assert r.bubble_formula == pytest.approx(bubble)
    assert r.timeline.bubble == pytest.approx((bubble,) * 4)
    assert r.timeline.peak_in_flight == in_flight
    assert [r.held_activation_bytes(s) for s in range(4)] == [n * a for n, a in zip(in_flight, (0, 1024, 1024, 2048))]
    # AdamW: parameter, gradient and two moments of 1,024 bytes each, plus the activations held.
    assert [r.rank_memory(k) for k in range(4)] == [4096 + n * a for n, a in zip(in_flight, (0, 1024, 1024, 2048))]


def test_sends_and_the_data_parallel_all_reduce_are_priced_by_alpha_beta():
    link = DeviceSpec("link", 1e9, 1e9, float("inf"), alpha=1e-6, link_bandwidth=1e9)
    r = report(device=link, world_size=8)  # 2 pipelines of 4 ranks
    assert r.data_parallel == 2
    assert [c.send_s for c in r.stages] == pytest.approx([1e-6 + 1024e-9] * 3 + [0.0])
    # ring all-reduce of one stage's 1,024 gradient bytes over 2: 2(N-1) alpha + 2(N-1)/N B beta
    assert r.dp_all_reduce_s == pytest.approx((2e-6 + 1024e-9,) * 4)
    assert r.step_time == pytest.approx(r.timeline.span + 2e-6 + 1024e-9)
    assert r.timeline.span > 33 * F  # the sends now sit on the critical path
    assert r.timeline.bubble[0] > 3 / 11


def test_explain_with_strategy_pipeline_returns_the_pipeline_report_and_keywords_are_checked():
    model, inputs = stack(rows=4)
    r = dpar.explain(model, inputs, world_size=4, strategy="pipeline", stages=4, micro_batches=8, loss_fn=mse,
                     device=FLOPS_ONLY)
    assert isinstance(r, PipelineReport) and r.ranks == 4 and r.schedule.micro_batches == 8
    with pytest.raises(dpar.OptionsError, match="apply only to strategy='pipeline'"):
        dpar.explain(model, inputs, world_size=4, strategy="ddp", stages=4)
    with pytest.raises(dpar.OptionsError, match="does not divide the pipeline's batch of 16 rows"):
        explain_pipeline(model, inputs, stages=4, micro_batches=5, loss_fn=mse)
    with pytest.raises(dpar.OptionsError, match="not a multiple of the pipeline's 4 ranks"):
        explain_pipeline(model, inputs, stages=4, micro_batches=8, loss_fn=mse, world_size=6)


def test_interleaved_schedule_puts_two_stages_on_each_rank():
    model, inputs = stack(rows=4)
    r = explain_pipeline(model, inputs, stages=4, micro_batches=4, schedule="interleaved_1f1b", loss_fn=mse,
                         device=FLOPS_ONLY)
    assert r.ranks == 2 and r.schedule.stages_of(0) == (0, 2)
    assert r.micro_batch_rows == 2  # 2 ranks x 4 rows in 4 micro-batches
    assert r.bubble_formula == pytest.approx(1 / 9)  # (p - 1) / (v m + p - 1)
    assert r.timeline.bubble == pytest.approx((1 / 9,) * 2)


def test_zbv_puts_stages_r_and_2p_minus_1_minus_r_on_rank_r_and_simulates_its_formula(tmp_path, capsys):
    model, inputs = stack(rows=4)
    r = explain_pipeline(model, inputs, stages=4, micro_batches=4, schedule="zbv", loss_fn=mse, device=FLOPS_ONLY)
    assert r.ranks == 2 and [r.schedule.stages_of(k) for k in range(2)] == [(0, 3), (1, 2)]
    assert r.micro_batch_rows == 2
    # F = I = W = one stage's forward, sends free: span 6m + max(p - 1, 4p - 2 - 2m) = 24 + 1 forwards
    assert r.timeline.span == pytest.approx(25 * F, rel=1e-12)
    assert r.bubble_formula == pytest.approx(1 / 25)
    assert r.timeline.bubble == pytest.approx((1 / 25,) * 2)
    assert r.timeline.peak_in_flight == (4, 3, 2, 1)
    # rank 0 holds stages 0 and 3 (the embedding's and the loss's), rank 1 stages 1 and 2: AdamW state of
    # 4,096 bytes a stage plus each stage's peak activations (a sum over the rank's stages: an upper bound)
    assert [r.rank_memory(k) for k in range(2)] == [2 * 4096 + 4 * 0 + 1 * 2048, 2 * 4096 + 3 * 1024 + 2 * 1024]
    trace = tmp_path / "zbv.json"
    out = inspect_stack(capsys, trace, "zbv", micro_batches=4)
    assert "zbv on 2 ranks x 2 stages in a V, 4 micro-batches of 2 rows" in out
    assert "bubble formula 4.0%" in out
    assert json.loads(trace.read_text())["otherData"]["peak_in_flight"] == [4, 3, 2, 1]
    with pytest.raises(dpar.TooFewBlocksError, match=r"stages=8 but the model has only 4 blocks in 'model.blocks' to cut "
                       r"between: schedule='zbv' runs 2 stages on each of the 4 ranks; use at most 4 stages: "
                       r"schedule='zb_h1' or '1f1b' with stages=4 \(one per rank\), 'zbv' on at most 2 ranks"):
        explain_pipeline(model, inputs, stages=8, micro_batches=8, schedule="zbv", loss_fn=mse)


def inspect_stack(capsys, trace: Path, schedule: str, micro_batches: int) -> str:
    """``dpar inspect --strategy pipeline`` of the 4-stage stack, its trace written to ``trace``: what it printed."""
    code = main(["inspect", f"{MODELS}:stack", "--strategy", "pipeline", "--stages", "4", "--micro-batches",
                 str(micro_batches), "--schedule", schedule, "--loss", f"{MODELS}:mse", "--trace", str(trace)])
    assert code == 0
    return capsys.readouterr().out


def test_cli_prints_split_schedule_and_bubble_and_writes_a_perfetto_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    out = inspect_stack(capsys, trace, "zb_h1", micro_batches=8)
    assert "zb_h1 on 4 ranks, 8 micro-batches of 2 rows" in out
    assert "1,024 B in" in out  # a boundary's bytes per micro-batch
    assert "bubble formula 11.1%" in out
    assert "... 20 more ..." in out  # rank 0's 40 actions, abbreviated
    doc = json.loads(trace.read_text())
    assert doc["otherData"]["peak_in_flight"] == [4, 4, 4, 4]
    ranks = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert ranks == {0, 1, 2, 3}
    computes = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    assert len(computes) == 4 * 8 * 3  # F, I and W of 8 micro-batches on every rank


def test_cli_without_a_loss_prices_next_token_cross_entropy_on_the_example_gpt(capsys):
    code = main(["inspect", str(MODELS.parent.parent / "examples" / "gpt.py"), "--strategy", "pipeline",
                 "--stages", "2", "--micro-batches", "4"])
    out = capsys.readouterr().out
    assert code == 0
    assert "GPT, 1f1b on 2 ranks, 4 micro-batches of 4 rows" in out  # 2 ranks x 8 rows / 4
    assert "131,072 B in" in out  # 4 rows x 64 tokens x 128 wide x 4 bytes


def test_cli_refuses_flags_of_the_data_parallel_report_and_a_missing_world_size():
    with pytest.raises(SystemExit, match="drop --html"):
        main(["inspect", f"{MODELS}:stack", "--strategy", "pipeline", "--stages", "2", "--html", "x.html"])
    with pytest.raises(SystemExit, match="needs --world-size"):
        main(["inspect", f"{MODELS}:stack"])


def test_tensor_parallel_stages_show_the_collectives_their_graphs_hold():
    """(pp 2, tp 2) x dp 2 of HF Llama: each stage's tp collectives are the ones dpar.pipeline's tp pass put in its
    graphs (two all-reduces per layer in F, the last stage's loss split by vocabulary; B's are I's and W's together), priced
    on the tp link and added to the actions' time, and each rank holds 1/tp of its stages' state."""
    from collections import Counter

    from pipeline_training import ROWS_PER_RANK, batch, build, token_loss

    pytest.importorskip("transformers")  # .ci/run's newest-torch stage installs no Hugging Face models
    x, y = batch(0, ROWS_PER_RANK)
    # The same pipeline without tp, at the same micro-batch rows (the tp ranks' slices join the pipeline's batch).
    plain = dpar.explain(build("llama", 4), (x, y), world_size=4, strategy="pipeline", stages=2, micro_batches=4,
                         schedule="zb_h1", loss_fn=token_loss, device="h100")
    split = dpar.explain(build("llama", 4), (x, y), world_size=8, strategy="pipeline", stages=2, micro_batches=8,
                         schedule="zb_h1", loss_fn=token_loss, device="h100", tensor_parallel=2)
    assert split.tp.degree == 2 and split.tp.read_off_graphs and split.data_parallel == 2
    found = [{op.value: Counter(kind for kind, _ in kinds) for op, kinds in split.tp.collectives[s].items()}
             for s in range(2)]
    # The last stage's loss stays split by vocabulary: its row max and sum and the loss all-reduced, no logits gathered.
    assert found[0]["F"] == {"all_reduce": 4} and found[1]["F"] == {"all_reduce": 4 + 3}
    assert found[0]["I"] == {}  # the first stage's input is token ids: no input gradient, its backward is all W
    for stage in range(2):
        assert found[stage]["I"] + found[stage]["W"] == found[stage]["B"] == {"all_reduce": found[stage]["B"]["all_reduce"]}
        seconds = split.tp.seconds[stage]
        assert seconds[Op.BACKWARD_INPUT] + seconds[Op.BACKWARD_WEIGHT] == pytest.approx(seconds[Op.BACKWARD])
        assert seconds[Op.FORWARD] > 0
    # The simulator replays each action as its half of the stage's compute plus its graph's tp collectives.
    for rank in range(2):
        ops = (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
        busy = 8 * sum(split.stages[rank].action_s(op) / 2 + split.tp.seconds[rank][op] for op in ops)
        assert split.timeline.busy[rank] == pytest.approx(busy)
    for rank in range(2):  # half of each stage's state and activations on each tp rank
        assert split.rank_memory(rank) == pytest.approx(plain.rank_memory(rank) / 2, abs=2)
    assert plain.tp.degree == 1 and not any(plain.tp.collectives)
    report = "\n".join(str(t) for t in split.tables())
    assert "each split over 2 tp ranks, its tp collectives read off its graphs" in report
    assert "F 4 all_reduce 0.008 ms; I none 0.000 ms; W 12 all_reduce 0.024 ms" in report


def test_tensor_parallel_inspection_refuses_what_the_pipeline_refuses(capsys):
    """The example GPT's fused qkv does not split over tp inside stages: dpar.pipeline's own error, before a graph."""
    assert main(["inspect", "examples/gpt.py", "--strategy", "pipeline", "--stages", "2", "--tp", "2", "-n", "4"]) == 2
    assert "does not divide the units a view cuts the output of blocks.0.attn.qkv.weight" in capsys.readouterr().out


def test_the_planner_prices_tp_with_the_collectives_the_pipelines_graphs_hold():
    """``block_collectives`` reads each block's tp collectives off a copy cut to three blocks; a stage's F and B are
    its blocks' in order, the same (kind and bytes) as the whole pipeline's graphs hold, and ``plan_pipeline``
    prices its tp candidates with them (a Llama layer cut alone: 4 all-reduces of its activations' gradients and 2
    of its norms' weights in the backward, where Megatron's model says 2)."""
    from collections import Counter

    from pipeline_training import ROWS_PER_RANK, batch, build, token_loss

    from dpar.compiler.pipeline_parallel.split import capture, find_blocks
    from dpar.inspect.pipeline import block_collectives
    from dpar.planner import plan_pipeline

    pytest.importorskip("transformers")
    x, y = batch(0, ROWS_PER_RANK)
    model = build("llama", 4)
    micro_batch = (x[:2], y[:2])  # the inspected pipeline's: 4 ranks' slices of 4 rows in 8 micro-batches
    prefix, _ = find_blocks(capture(model, token_loss, micro_batch))
    read = block_collectives(model, prefix, micro_batch, token_loss, pipeline=dpar.pipeline)
    assert len(list(model.get_submodule(prefix.removeprefix("model.")).children())) == 4  # the model is not cut
    whole = dpar.explain(model, (x, y), world_size=4, strategy="pipeline", stages=2, micro_batches=8,
                         schedule="zb_h1", loss_fn=token_loss, device="h100", tensor_parallel=2)
    composed = read.of_stages([len(s.blocks) for s in whole.split.stages])
    for stage in range(2):
        assert Counter(composed[stage][Op.FORWARD]) == Counter(whole.tp.collectives[stage][Op.FORWARD]), stage
        split = Counter(composed[stage][Op.BACKWARD_INPUT]) + Counter(composed[stage][Op.BACKWARD_WEIGHT])
        assert split == Counter(composed[stage][Op.BACKWARD]), stage
    # The backward is the blocks' sum where no input gradient crosses between them (the first stage), and 2 block
    # input gradients more than the stage's graph where one does: a block cut alone hands its input gradient on
    # reduced, where inside one stage the partial sums of two blocks are reduced together ([Note: a reduction already
    # made is free]). The first stage has no input gradient: its backward is all W.
    assert Counter(composed[0][Op.BACKWARD]) == Counter(whole.tp.collectives[0][Op.BACKWARD])
    activation = ("all_reduce", 2048)  # a block input's gradient, one micro-batch
    assert Counter(composed[1][Op.BACKWARD]) - Counter(whole.tp.collectives[1][Op.BACKWARD]) == {activation: 2}
    assert len(composed[0][Op.BACKWARD_INPUT]) == len(whole.tp.collectives[0][Op.BACKWARD_INPUT]) == 0
    assert (len(composed[1][Op.BACKWARD_INPUT]), len(whole.tp.collectives[1][Op.BACKWARD_INPUT])) == (8, 6)
    assert Counter(k for k, _ in read.middle[Op.BACKWARD]) == {"all_reduce": 6}
    assert Counter(k for k, _ in read.middle[Op.FORWARD]) == {"all_reduce": 2}

    def planned(**kwargs):
        return plan_pipeline(model, batch(0, 16), world_size=4, loss_fn=token_loss, micro_batch_rows=2,
                             memory_budget_gb=None, dp_strategies=("ddp",), **kwargs)

    megatron = planned()
    graphs = planned(read_tp_collectives=functools.partial(block_collectives, model, pipeline=dpar.pipeline))
    assert graphs.tp_read_off_graphs and not megatron.tp_read_off_graphs
    tp_seconds = {(c.pp, c.tp): c.tp_s for c in megatron.candidates}
    for c in graphs.candidates:
        assert (c.tp_s > tp_seconds[c.pp, c.tp]) if c.tp > 1 else c.tp_s == 0, c.layout
