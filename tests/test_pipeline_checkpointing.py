"""Activation checkpointing inside pipeline stages (``dpar.pipeline(..., activation_checkpointing=...)``).

A stage's cut recomputes what the policy tags ([Note: activation checkpointing inside a pipeline stage] in
``compiler/pipeline_parallel/stage_graphs.py``): the numbers equal the same pipeline keeping everything, bit for
bit on CPU in fp32, under zbv's split backward (I and W) and 1F1B's whole one; what the forward saves shrinks from
keep to selective to full; no collective is added to the backward; and on 2 gloo ranks it trains as torch DDP does.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

import dpar
from distributed import run_ranks
from dpar.compiler.collectives import is_communication
from dpar.compiler.passes.recompute import BLOCK_KEY, RECOMPUTE_KEY
from fake_world import fake_world
from pipeline_training import batch, build, optimizer, pipelined, token_loss, torch_ddp
from training import TOLERANCE, max_abs_diff

POLICIES = ("keep", "selective", "full")


def _saved_bytes(graphs) -> int:
    """Bytes a stage's forward saves for its backward per micro-batch: distinct storages, received activations
    included, parameters and the batch not (the pipeline cost model's count)."""
    from dpar.compiler.pipeline_parallel.stage_graphs import saved_activation_bytes

    return saved_activation_bytes(graphs)[0]


def _recomputed(gm: fx.GraphModule) -> list[fx.Node]:
    """The forward ops a backward graph computes again (they carry the block the policy tagged)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and BLOCK_KEY in n.meta]


def _train_one_process(schedule: str, stages: int, policy: str | dpar.ActivationPolicy) -> tuple[list[float], dict, dict]:
    model = build("llama", 2)
    x, y = batch(0, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = dpar.pipeline(model, token_loss, example_inputs=(x, y), stages=stages, micro_batches=2,
                             schedule=schedule, activation_checkpointing=policy)
    opt = optimizer("adamw", model.parameters())
    losses = []
    for i in range(3):
        x, y = batch(i, 4)
        losses.append(step(x, y).item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, step.graphs


@pytest.mark.parametrize(("schedule", "stages"), [("zbv", 2), ("1f1b", 1)])
def test_recomputing_stages_train_bit_for_bit_as_keeping_ones_and_save_less(schedule: str, stages: int) -> None:
    """One process: zbv puts both stages of a V on it (I and W apart), 1F1B one stage (B whole)."""
    runs = {policy: _train_one_process(schedule, stages, policy) for policy in POLICIES}
    keep_losses, keep_state, keep_graphs = runs["keep"]
    for policy in ("selective", "full"):
        losses, state, graphs = runs[policy]
        assert losses == keep_losses, policy
        assert all(torch.equal(state[k], keep_state[k]) for k in keep_state), policy
        for s, g in graphs.items():
            backward = g.backward_input if schedule == "zbv" else g.backward
            assert _recomputed(backward) or _recomputed(g.backward_weight), (policy, s)
            assert not _recomputed(keep_graphs[s].backward) and not _recomputed(keep_graphs[s].backward_weight)
    for s in keep_graphs:
        saved = [_saved_bytes(runs[policy][2][s]) for policy in POLICIES]
        print(f"{schedule} stage {s}: forward saves {saved} bytes (keep, selective, full)")
        assert saved[0] > saved[1] > saved[2], saved
    # selective recomputes no matmul: every mm of the forward is saved, none runs again in the backward
    for g in runs["selective"][2].values():
        for gm in (g.backward, g.backward_input, g.backward_weight):
            assert not [n for n in _recomputed(gm) if n.target is torch.ops.aten.mm.default]


def test_tensor_parallel_stages_recompute_without_a_collective() -> None:
    """(pp 2, tp 2) in a fake world, rank 0's stage: its forward's tp all-reduces are saved (must-save), never run
    again, so the backward holds the same collectives under full as under keep, and saves less."""
    from torch.distributed.device_mesh import init_device_mesh

    graphs = {}
    for policy in ("keep", "full"):
        with fake_world(4), warnings.catch_warnings():
            warnings.simplefilter("ignore", dpar.PipelineBubbleWarning)
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
            x, y = batch(0, 4)
            step = dpar.pipeline(build("llama", 4), token_loss, example_inputs=(x, y), stages=2, micro_batches=4,
                                 mesh=mesh, activation_checkpointing=policy)
            graphs[policy] = step.graphs[0]

    def collectives(gm: fx.GraphModule) -> list[str]:
        return sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and is_communication(n))

    keep, full = graphs["keep"], graphs["full"]
    assert collectives(full.backward) == collectives(keep.backward) and collectives(keep.backward)
    assert collectives(full.forward) == collectives(keep.forward)
    recomputed = _recomputed(full.backward)
    assert recomputed and not [n for n in recomputed if is_communication(n)]
    assert all(n.meta.get(RECOMPUTE_KEY) is CheckpointPolicy.PREFER_RECOMPUTE for n in recomputed)
    assert _saved_bytes(full) < _saved_bytes(keep)


def _zbv_full_and_torch_ddp(rank: int, world_size: int) -> tuple:
    warnings.simplefilter("ignore", dpar.PipelineBubbleWarning)
    state, losses, _, _ = pipelined(rank, world_size, "llama", 4, "adamw", "zbv", 4, 4,
                                    activation_checkpointing="full")
    return state, losses, torch_ddp(rank, world_size, "llama", 4, "adamw")


def test_zbv_with_full_recomputation_matches_torch_ddp() -> None:
    """2 gloo ranks, 4 stages in a V, every block recomputed: torch DDP's parameters on the same slices."""
    state, _, ddp = run_ranks(_zbv_full_and_torch_ddp, 2, timeout_s=300)[0]
    diff = max_abs_diff(ddp, state)
    print(f"zbv, full recomputation, 2 ranks: max |difference| from torch DDP {diff:.2e}")
    assert diff < TOLERANCE["adamw"]


def test_bad_policies_are_refused_by_name() -> None:
    x, y = batch(0, 4)
    with pytest.raises(dpar.ActivationPolicyError, match=r"has no block 'inner.model.layers.7'"):
        dpar.pipeline(build("llama", 2), token_loss, example_inputs=(x, y), stages=1, micro_batches=2,
                      activation_checkpointing={"inner.model.layers.7": "full"})
    with pytest.raises(dpar.ActivationPolicyError, match=r"budget of 10,000 bytes per micro-batch: stage 0's forward "
                                                        r"saves 19,652 bytes even recomputing .* at least 19,652"):
        dpar.pipeline(build("llama", 2), token_loss, example_inputs=(x, y), stages=1, micro_batches=2,
                      activation_checkpointing=dpar.ActivationPolicy(budget_bytes=10_000))


def test_a_budget_recomputes_block_by_block_until_the_stage_fits() -> None:
    """One 1F1B stage of 2 blocks saves 86,340 / 48,324 / 19,652 bytes a micro-batch under keep / selective /
    full (the first test): a budget between selective and full recomputes the first block fully, the second
    selectively, and trains bit for bit as keeping everything."""
    keep_losses, keep_state, _ = _train_one_process("1f1b", 1, "keep")
    losses, state, graphs = _train_one_process("1f1b", 1, dpar.ActivationPolicy(budget_bytes=40_000))
    saved = _saved_bytes(graphs[0])
    print(f"budget 40,000 bytes: the stage saves {saved:,}")
    assert 19_652 < saved <= 40_000
    assert losses == keep_losses and all(torch.equal(state[k], keep_state[k]) for k in keep_state)
    from dpar.core.plan import Recompute

    assert [r for _, r in graphs[0].activations.blocks] == [Recompute.FULL, Recompute.SELECTIVE]


# ---- the pipeline planner chooses the policy ------------------------------------------------------------------


def _planned(budget_bytes: float | None, world_size: int = 1):
    from dpar.planner import plan_pipeline

    x, y = batch(0, 4)
    return plan_pipeline(build("llama", 4), (x, y), world_size=world_size, loss_fn=token_loss, device="cpu",
                         memory_budget_gb=None if budget_bytes is None else budget_bytes / 1e9, tp_max=1,
                         dp_strategies=("ddp",), micro_batch_rows=4 // world_size)


def test_the_pipeline_planner_recomputes_only_what_the_budget_needs() -> None:
    """Known answers on one rank (one layout, three policies): a budget that fits everything keeps everything, a
    tighter one recomputes selectively, then fully; below full's footprint a named error gives it."""
    free = _planned(None)
    by_policy = {c.activations: c for c in free.candidates}
    keep, selective, full = (by_policy[p] for p in POLICIES)
    assert keep.step_s < selective.step_s < full.step_s and keep.recompute_s == 0 < selective.recompute_s < full.recompute_s
    assert keep.memory_bytes > selective.memory_bytes > full.memory_bytes
    assert free.choice is keep
    assert _planned(keep.memory_bytes).choice.activations == "keep"
    assert _planned(keep.memory_bytes - 1).choice.activations == "selective"
    assert _planned(selective.memory_bytes - 1).choice.activations == "full"
    with pytest.raises(dpar.PipelineMemoryError, match=rf"least memory is pp=1 x tp=1 x dp=1 \(ddp, full recomputation\) "
                                                        rf"with {full.memory_bytes / 1e9:.4g} GB"):
        _planned(full.memory_bytes - 1)
    print(f"one rank: keep {keep.memory_bytes:,} B {keep.step_s * 1e3:.3f} ms, selective {selective.memory_bytes:,} B "
          f"{selective.step_s * 1e3:.3f} ms, full {full.memory_bytes:,} B {full.step_s * 1e3:.3f} ms")


def test_inspect_prices_the_policy_from_the_stage_graphs(capsys) -> None:
    """``dpar.explain(strategy="pipeline", activation_checkpointing=...)`` and ``dpar inspect --strategy pipeline
    --activation-checkpointing``: each stage saves what its cut under the policy saves (the bytes above, per
    micro-batch of 2 rows, 1F1B on one rank) and its backward adds the ops it recomputes."""
    from pathlib import Path

    from dpar.cli import main

    x, y = batch(0, 4)
    reports = {policy: dpar.explain(build("llama", 2), (x, y), strategy="pipeline", world_size=1, stages=1, micro_batches=2,
                                    loss_fn=token_loss, device="cpu", activation_checkpointing=policy)
               for policy in POLICIES}
    stages = {policy: r.stages[0] for policy, r in reports.items()}
    assert [stages[p].activation_bytes for p in POLICIES] == [86_340, 48_324, 19_652]
    assert stages["keep"].recompute_s == 0 < stages["selective"].recompute_s < stages["full"].recompute_s
    assert reports["keep"].step_time < reports["selective"].step_time < reports["full"].step_time
    models = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
    assert main(["inspect", str(models), "--strategy", "pipeline", "--stages", "2", "--micro-batches", "4",
                 "--device", "cpu", "--activation-checkpointing", "selective"]) == 0
    assert "activations selective, recomputed in B (I + W)" in capsys.readouterr().out


def _fsdp_zbv_full(rank: int, world_size: int) -> tuple:
    warnings.simplefilter("ignore", dpar.PipelineBubbleWarning)
    state, losses, _, _ = pipelined(rank, world_size, "llama", 4, "adamw", "zbv", 4, 4, mesh_shape=(2, 2),
                                    dp_strategy="fsdp", activation_checkpointing="full")
    return state, losses


# The 2-rank zbv case above trains the recomputing cut by default; fsdp over dp gathers outside the stage graphs.
@pytest.mark.extended
def test_fsdp_over_dp_with_full_recomputation_matches_one_process() -> None:
    """(dp 2, pp 2), zbv, fsdp over dp (parameters gathered once per step), every block recomputed: one process's
    parameters on the global batch."""
    from pipeline_training import one_process

    reference, reference_losses = one_process("llama", 4, "adamw", 4)
    state, losses = run_ranks(_fsdp_zbv_full, 4, timeout_s=400)[0]
    diff = max_abs_diff(reference, state)
    print(f"fsdp over dp x zbv, full recomputation, 4 ranks: max |difference| from one process {diff:.2e}")
    assert diff < TOLERANCE["adamw"] and losses == pytest.approx(reference_losses, rel=1e-5)
