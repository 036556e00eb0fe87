"""dpar.pipeline against one process on the global batch, on gloo ranks, every schedule; bad input.

Each rank is fed its own slice; the pipeline group trains on all of them, so after 5 steps the
parameters must equal one process on the whole batch (tolerances from NOTES.md). Several
schedules share one launch of the ranks, each from a freshly seeded model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import dpar
from distributed import run_ranks
from pipeline_training import ROWS_PER_RANK, batch, build, one_process, pipelined, token_loss, torch_ddp
from training import max_abs_diff

TOLERANCE = {"sgd": 1e-5, "adamw": 1e-4}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def _every_schedule(rank: int, world_size: int, name: str, layers: int, optim: str, micro_batches: int,
                    schedules: tuple[str, ...]) -> dict[str, tuple]:
    warnings.simplefilter("ignore", dpar.PipelineBubbleWarning)
    results = {}
    for schedule in schedules:
        stages = 2 * world_size if schedule == "interleaved_1f1b" else world_size
        state, losses, _, peak = pipelined(rank, world_size, name, layers, optim, schedule, stages, micro_batches)
        results[schedule] = (state, losses, peak)
    return results


@pytest.mark.parametrize(
    "name, layers, optim, world_size, micro_batches",
    [
        ("llama", 4, "adamw", 2, 4),  # a Llama-style model this project did not write (RoPE, GQA, RMSNorm)
        ("gpt2", 4, "sgd", 2, 4),  # tied embedding and head on the first and last stage
        # 4 stages: ZBV's and the 8-rank 3-D test's 4-rank pipelines run as deep: `-m extended`.
        pytest.param("llama", 8, "adamw", 4, 8, marks=pytest.mark.extended),
    ],
    ids=["llama-2-stages", "gpt2-tied-2-stages", "llama-4-stages"],
)
def test_every_schedule_matches_one_process(name, layers, optim, world_size, micro_batches):
    reference, reference_losses = one_process(name, layers, optim, world_size)
    results = run_ranks(_every_schedule, world_size, name, layers, optim, micro_batches, SCHEDULES, timeout_s=300)
    for schedule in SCHEDULES:
        state, losses, _ = results[0][schedule]
        assert max_abs_diff(reference, state) < TOLERANCE[optim], schedule
        for rank_result in results:  # every rank returns the same mean loss, the global batch's
            assert rank_result[schedule][1] == pytest.approx(reference_losses, rel=1e-5), schedule
    # Activations held (micro-batches with saved forward values, per stage): 1F1B at most p - r on rank r,
    # GPipe all m, ZB-H1 p on every rank (a micro-batch is held until its W).
    for rank, result in enumerate(results):
        assert result["gpipe"][2] == {rank: micro_batches}
        assert result["1f1b"][2] == {rank: world_size - rank}
        assert result["zb_h1"][2] == {rank: world_size}


def _zbv_and_torch_ddp(rank: int, world_size: int, name: str, layers: int, optim: str, micro_batches: int
                       ) -> tuple:
    warnings.simplefilter("ignore", dpar.PipelineBubbleWarning)
    state, losses, _, peak = pipelined(rank, world_size, name, layers, optim, "zbv", 2 * world_size, micro_batches)
    return state, losses, peak, torch_ddp(rank, world_size, name, layers, optim)


@pytest.mark.parametrize(
    "name, layers, optim, world_size, micro_batches",
    [
        pytest.param("llama", 4, "adamw", 2, 4, marks=pytest.mark.extended),  # the GPT-2's V below, every schedule's Llama
        ("gpt2", 4, "sgd", 2, 4),  # the tied embedding and head both on rank 0 (stages 0 and 3)
        # 4 ranks, 8 stages: the V over more ranks than test_pipeline_checkpointing's 2-rank zbv (the suite's time)
        pytest.param("llama", 8, "adamw", 4, 8, marks=pytest.mark.extended),
    ],
    ids=["llama-2-ranks", "gpt2-tied-2-ranks", "llama-4-ranks"],
)
def test_zbv_matches_one_process_and_torch_ddp(name, layers, optim, world_size, micro_batches):
    """Two stages on each rank in a V (stages r and 2p - 1 - r), split backwards: the same parameters as one process
    on the global batch and as torch DDP on the same slices; each stage holds what the simulator says it holds."""
    from dpar.compiler.pipeline_parallel.schedules import build_schedule
    from dpar.compiler.pipeline_parallel.simulate import simulate

    reference, reference_losses = one_process(name, layers, optim, world_size)
    results = run_ranks(_zbv_and_torch_ddp, world_size, name, layers, optim, micro_batches, timeout_s=300)
    state, _, _, ddp = results[0]
    assert max_abs_diff(reference, state) < TOLERANCE[optim]
    assert max_abs_diff(ddp, state) < TOLERANCE[optim]
    simulated = simulate(build_schedule("zbv", num_ranks=world_size, micro_batches=micro_batches)).peak_in_flight
    for rank, (_, losses, peak, _) in enumerate(results):
        assert losses == pytest.approx(reference_losses, rel=1e-5)
        assert peak == {s: simulated[s] for s in (rank, 2 * world_size - 1 - rank)}


DP_CASES = (("ddp", "1f1b"), ("ddp", "zb_h1"), ("fsdp", "1f1b"), ("fsdp", "zb_h1"))  # sync in the last B, or W


def _dp_pp(rank: int, world_size: int, cases: tuple[tuple[str, ...], ...]) -> dict[tuple[str, ...], tuple]:
    """Each case: (dp_strategy, schedule), or with the stage compiler third (default aot_eager)."""
    results = {}
    for dp_strategy, schedule, *compiler in cases:
        stages = 4 if schedule == "zbv" else 2  # two stages on each of the pipeline's 2 ranks in a V
        model_state, losses, _, _ = pipelined(rank, world_size, "llama", 4, "adamw", schedule, stages, 4,
                                              mesh_shape=(2, 2), dp_strategy=dp_strategy,
                                              compiler=compiler[0] if compiler else "aot_eager")
        results[(dp_strategy, schedule, *compiler)] = (model_state, losses)
    return results


def _assert_dp_pp_matches_one_process(cases: tuple[tuple[str, ...], ...]) -> None:
    reference, reference_losses = one_process("llama", 4, "adamw", 4)
    results = run_ranks(_dp_pp, 4, cases, timeout_s=400)
    for case in cases:
        assert max_abs_diff(reference, results[0][case][0]) < TOLERANCE["adamw"], case
        for result in results:
            assert result[case][1] == pytest.approx(reference_losses, rel=1e-5), case


def test_dp_by_pp_mesh_matches_one_process():
    """(dp=2, pp=2): two pipelines, each on its members' slices, gradients averaged (or reduce-scattered) over dp."""
    _assert_dp_pp_matches_one_process(DP_CASES)


# By default the 8-rank 3-D test trains fsdp under zbv over dp (with tp): `-m extended` both.
@pytest.mark.extended
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_zbv_over_a_dp_by_pp_mesh_matches_one_process(compiler: str):
    """(dp=2, pp=2) with 4 stages in a V: each rank syncs both its stages over dp in their last W. With Inductor:
    the gather variant of each stage's first F and the reduce-scatter variant of its last W lowered with the stage
    graphs ([Note: compiled pipeline stages])."""
    _assert_dp_pp_matches_one_process((("fsdp", "zbv", compiler),))


def test_dp_all_reduce_is_in_the_last_backward_graph(world_of_four):
    """ddp's pass over dp: buckets of the stage's parameters, all-reduced in the sync variant only."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    model = build("llama", 4)
    step = dpar.pipeline(model, token_loss, example_inputs=_slice(), stages=2, micro_batches=8, mesh=mesh,
                         schedule="zb_h1", bucket_cap_mb=1)
    (stage,) = step.graphs
    variant = step.executor.sync[stage]
    reduces = [n for n in variant.graph.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    numel = sum(n.args[0].meta["val"].numel() for n in reduces)
    assert numel == sum(p.numel() for p in model.parameters() if p.numel() > 0)  # this stage's parameters, once
    assert len(variant.accumulated) == len(step.graphs[stage].parameter_names)
    plain = step.graphs[stage].backward_weight
    assert not [n for n in plain.graph.nodes if "all_reduce" in str(n.target)]


def test_fsdp_over_dp_gathers_once_and_reduce_scatters_once(world_of_four):
    """Shards at rest (1/dp of each parameter), one all-gather in the first F, one reduce-scatter in the last W."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    model = build("llama", 4)
    whole = {n: p.numel() for n, p in model.named_parameters()}
    step = dpar.pipeline(model, token_loss, example_inputs=_slice(), stages=2, micro_batches=8, mesh=mesh,
                         schedule="zb_h1", dp_strategy="fsdp")
    (stage,) = step.graphs
    names = step.graphs[stage].parameter_names
    held = dict(model.named_parameters())  # Shard(0) DTensors of the whole shape, this rank's rows local
    assert {n: held[n].numel() for n in names} == {n: whole[n] for n in names}
    assert {n: held[n].to_local().numel() for n in names} == {n: -(-whole[n] // 2) for n in names}

    def collectives(gm):
        return [str(n.target) for n in gm.graph.nodes if "_c10d_functional" in str(n.target) and "wait" not in str(n.target)]

    assert collectives(step.executor.gather[stage]) == ["_c10d_functional.all_gather_into_tensor.default"]
    assert collectives(step.executor.sync[stage].graph) == ["_c10d_functional.reduce_scatter_tensor.default"]
    assert not collectives(step.graphs[stage].forward) and not collectives(step.graphs[stage].backward_weight)


def test_one_process_without_a_process_group():
    reference, _ = one_process("llama", 2, "sgd", 1)
    state, _, _, _ = pipelined(0, 1, "llama", 2, "sgd", "1f1b", 1, 2)
    assert max_abs_diff(reference, state) < TOLERANCE["sgd"]


def _uneven_slices(rank: int, world_size: int) -> str:
    x, y = batch(0, ROWS_PER_RANK - rank)  # rank 1 is fed fewer rows than rank 0
    try:
        dpar.pipeline(build("llama", 2), token_loss, example_inputs=(x, y), stages=2, micro_batches=2)
    except dpar.CollectiveMismatchError as error:
        # Every rank raises; none may leave (rank 0 hosts the store) before the others have read the lines.
        torch.distributed.barrier()
        return str(error)
    return "built"


def test_ranks_that_cut_different_stages_fail_at_build_not_in_a_hang():
    for message in run_ranks(_uneven_slices, 2, timeout_s=120):
        assert message.startswith("pipeline stage splits, schedules and input shapes differ between ranks")
        assert "sends 4096 bytes" in message and "sends 3072 bytes" in message  # stage 0's activations per rank


class _BatchNormStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _CountingStack(nn.Module):
    """Blocks that count, under ``torch.no_grad()``, how many of their outputs are positive (as torchtitan's MoE
    counts the tokens each expert gets), or (``average``) keep a running mean of them in a buffer instead."""

    def __init__(self, average: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        for layer in self.layers:
            layer.register_buffer("seen", torch.zeros(8), persistent=False)
        self.average = average

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
            with torch.no_grad():
                if self.average:
                    layer.seen.mul_(0.9).add_(x.mean(0), alpha=0.1)
                else:
                    layer.seen.add_((x > 0).sum(0))
        return x


def _counted(rank: int, world_size: int) -> tuple[dict | None, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _CountingStack()
    x = torch.randn(8 * world_size, 8, generator=torch.Generator().manual_seed(1))
    step = dpar.pipeline(model, nn.functional.mse_loss, example_inputs=(x.chunk(world_size)[rank],) * 2, stages=2,
                         micro_batches=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        step(x.chunk(world_size)[rank], x.chunk(world_size)[rank])
        opt.step()
        opt.zero_grad()
    return dpar.checkpoint.full_state_dict(model), [layer.seen.clone() for layer in model.layers]


def test_a_buffer_the_forward_accumulates_into_holds_the_batchs_sum():
    """[Note: a buffer a stage's forward accumulates into]: each stage's counts over its micro-batches are one
    forward of the pipeline's batch's; the parameters are one process's."""
    torch.manual_seed(0)
    model = _CountingStack()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        nn.functional.mse_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    results = run_ranks(_counted, 2, timeout_s=120)
    state, _ = results[0]
    assert max_abs_diff(model.state_dict(), state) < 1e-6
    for rank, (_, seen) in enumerate(results):  # each rank's stage holds its block's counts
        assert torch.equal(seen[rank], model.layers[rank].seen), rank
        assert seen[rank].sum() > 0


def test_a_buffer_the_forward_writes_otherwise_is_refused(world_of_two):
    x = torch.randn(4, 8)
    with pytest.raises(dpar.OptionsError, match=r"writes buffer layers\.0\.seen in place with aten\.mul_.*\(not an "
                                                 r"accumulation"):
        dpar.pipeline(_CountingStack(average=True), nn.functional.mse_loss, example_inputs=(x, x), stages=2,
                      micro_batches=2)


def _slice() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(0, ROWS_PER_RANK)
    return x, y


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(micro_batches=3, stages=4, schedule="1f1b"), r"micro_batches=3 does not divide the pipeline group's batch of 16 rows .* use one of \[1, 2, 4, 8, 16\]"),
        (dict(), r"stages=8 but the model has only 2 blocks .* use at most 2 stages"),
        (dict(stages=4), r"interleaved_1f1b runs at least 2 stages on each rank: stages=8 \(or 12, 16, ...\) on 4 ranks"),
        (dict(stages=3), r"stages=3 cannot be spread over the 4 ranks"),
        (dict(schedule="1fb1"), r"unknown pipeline schedule '1fb1' \(did you mean '1f1b'\?\)"),
        (dict(stages=8, schedule="1f1b"), r"puts 2 stages on each rank, which only schedule='interleaved_1f1b' runs"),
        (dict(micro_batches=6), r"interleaved_1f1b runs micro-batches in rounds of num_ranks=4"),
    ],
    ids=["micro-batches-do-not-divide", "more-stages-than-blocks", "one-stage-a-rank-interleaved", "stages-not-a-multiple", "unknown-schedule",
         "two-stages-a-rank-without-interleaving", "interleaved-rounds"],
)
def test_bad_arguments_name_the_fix(world_of_four, kwargs, message):
    arguments = dict(example_inputs=_slice(), stages=8, micro_batches=4, schedule="interleaved_1f1b") | kwargs
    with pytest.raises(dpar.OptionsError, match=message):
        dpar.pipeline(build("llama", 2), token_loss, **arguments)


@pytest.mark.parametrize(
    "layers, kwargs, error, message",
    [
        (2, dict(stages=4), dpar.OptionsError,
         r"zbv runs exactly 2 stages on each rank, in a V \(rank r holds stages r and 7 - r\): stages=8 on 4 ranks, "
         r"not stages=4; or use schedule='zb_h1' with stages=4"),
        (6, dict(), dpar.TooFewBlocksError,
         r"stages=8 but the model has only 6 blocks in '.*layers' to cut between: schedule='zbv' runs 2 stages on each "
         r"of the 4 ranks; use at most 6 stages: schedule='zb_h1' or '1f1b' with stages=4 \(one per rank\), 'zbv' on at "
         r"most 3 ranks, or a deeper model"),
        (2, dict(schedule="interleaved_1f1b", micro_batches=2), dpar.TooFewMicroBatchesError,
         r"interleaved_1f1b needs at least 4 micro-batches on 4 ranks .* got 2; use micro_batches=4"),
    ],
    ids=["zbv-one-stage-a-rank", "zbv-fewer-blocks-than-2p", "interleaved-fewer-micro-batches-than-ranks"],
)
def test_zbv_and_micro_batch_counts_are_refused_before_a_step_with_the_fix(world_of_four, layers, kwargs, error,
                                                                           message):
    arguments = dict(example_inputs=_slice(), stages=8, micro_batches=8, schedule="zbv") | kwargs
    with pytest.raises(error, match=message):
        dpar.pipeline(build("llama", layers), token_loss, **arguments)


def test_a_split_point_that_leaves_a_stage_empty(world_of_two):
    model = build("llama", 4)
    with pytest.raises(dpar.OptionsError, match=r"leave a stage without blocks"):
        dpar.pipeline(model, token_loss, example_inputs=_slice(), stages=2, micro_batches=4,
                      split_points=["layers.0"])
    with pytest.raises(dpar.OptionsError, match=r"'blocks.9' is not one of the blocks"):
        dpar.pipeline(build("llama", 4), token_loss, example_inputs=_slice(), stages=2, micro_batches=4,
                      split_points=["blocks.9"])


def test_user_split_points_place_the_blocks(world_of_two):
    step = dpar.pipeline(build("llama", 4), token_loss, example_inputs=_slice(), stages=2, micro_batches=4,
                         split_points=["layers.3"])
    assert [s.blocks[0].rsplit(".", 1)[1] for s in step.split.stages] == ["0", "3"]
    assert [len(s.blocks) for s in step.split.stages] == [3, 1]


def test_buffers_updated_in_forward_are_refused(world_of_two):
    x = torch.randn(4, 8)
    with pytest.raises(dpar.OptionsError, match=r"updates buffers .*running_mean.* Use a normalisation without running"):
        dpar.pipeline(_BatchNormStack(), nn.functional.mse_loss, example_inputs=(x, x), stages=2, micro_batches=2)


def test_a_batch_of_another_shape_is_refused(world_of_two):
    step = dpar.pipeline(build("llama", 2), token_loss, example_inputs=_slice(), stages=2, micro_batches=8)
    x, y = batch(0, ROWS_PER_RANK + 1)
    with pytest.raises(dpar.OptionsError, match=r"built for inputs of shapes .*drop_last=True"):
        step(x, y)


def test_few_micro_batches_warn_with_the_bubble(world_of_two):
    with pytest.warns(dpar.PipelineBubbleWarning, match=r"20.0%"):
        dpar.pipeline(build("llama", 2), token_loss, example_inputs=_slice(), stages=2, micro_batches=4)


def test_each_rank_releases_the_other_stages_parameters(world_of_two):
    model = build("llama", 2)
    total = sum(p.numel() for p in model.parameters())
    step = dpar.pipeline(model, token_loss, example_inputs=_slice(), stages=2, micro_batches=8)
    held = sum(p.numel() for p in model.parameters())
    stage0 = {n for n in step.split.stages[0].parameters}
    expected = sum(p.numel() for n, p in build("llama", 2).named_parameters() if n in stage0)
    assert held == expected < total
