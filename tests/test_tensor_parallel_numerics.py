"""Numerics: tp on 2 and 4 gloo ranks, ddp+tp and fsdp+tp on 2x2, against one process on the whole batch."""

from __future__ import annotations

import functools

import pytest

from distributed import run_ranks
from tensor_parallel_training import single_process, train_parallel
from training import TOLERANCE, Case, max_abs_diff

EXTENDED = pytest.mark.extended
CONFIGS = [
    pytest.param("tp", 2, "mlp", "sgd", marks=EXTENDED),  # adamw's case below covers it
    ("tp", 2, "mlp", "adamw"),
    pytest.param("tp", 2, "gpt", "adamw", marks=EXTENDED),  # the GPT's 4-rank case and HF's tp 2 cases cover it
    pytest.param("tp", 4, "mlp", "adamw", marks=EXTENDED),  # the GPT's 4-rank case covers it
    ("tp", 4, "gpt", "adamw"),  # 2 heads over 4 ranks: attention runs gathered, the rest split
    pytest.param("fsdp+tp", 4, "mlp", "adamw", marks=EXTENDED),
    pytest.param("fsdp+tp", 4, "gpt", "adamw", marks=EXTENDED),  # with sequence parallel below
    pytest.param("ddp+tp", 4, "gpt", "adamw", marks=EXTENDED),  # test_fsdp_tp_models' odd-vocabulary Llama trains ddp+tp
    pytest.param("zero2+tp", 4, "gpt", "sgd", marks=EXTENDED),  # test_fsdp_tp_models' odd-vocabulary Llama trains zero2+tp
]


def _ids(configs: list) -> list[str]:
    return ["-".join(map(str, c.values if hasattr(c, "values") else c)) for c in configs]


@pytest.mark.parametrize("strategy,world,model,optimizer", CONFIGS, ids=_ids(CONFIGS))
def test_matches_one_process_on_the_whole_batch(strategy: str, world: int, model: str, optimizer: str) -> None:
    case = Case(model, optimizer)
    parallel = run_ranks(train_parallel, world, case, strategy)[0]
    diff = max_abs_diff(parallel, single_process(case))
    print(f"{strategy} at {world} ranks, {case.id}: max |difference| {diff:.2e}")
    assert diff <= TOLERANCE[optimizer]


SEQUENCE_PARALLEL = [  # tp + SP on 4 ranks of HF Llama: tests/test_third_party_models.py
    pytest.param("tp", 2, "adamw", marks=EXTENDED),
    pytest.param("tp", 4, "adamw", marks=EXTENDED),
    ("fsdp+tp", 4, "adamw"),
]


@pytest.mark.parametrize("strategy,world,optimizer", SEQUENCE_PARALLEL, ids=_ids(SEQUENCE_PARALLEL))
def test_sequence_parallel_matches_one_process(strategy: str, world: int, optimizer: str) -> None:
    case = Case("gpt", optimizer)
    parallel = run_ranks(functools.partial(train_parallel, sequence_parallel=True), world, case, strategy)[0]
    diff = max_abs_diff(parallel, single_process(case))
    print(f"{strategy} + sequence parallel at {world} ranks, {case.id}: max |difference| {diff:.2e}")
    assert diff <= TOLERANCE[optimizer]


def train_planned(
    rank: int, world_size: int, case: Case, roles: tuple[str, ...], links: tuple[float, float]
) -> tuple[str, bool, dict[str, int | None], dict]:
    """``dpar.plan`` with the mesh dimension's role fixed, on a 100 GFLOP/s device whose links are ``links`` (α, β),
    applied by ``parallelize(plan=...)``: (its strategy, whether it is sequence parallel, its tp dims, the trained
    state)."""
    import dpar
    from dpar.compiler.costs import DeviceSpec
    from training import global_batch, seeded_model

    x0, _ = global_batch(case.model, 0, 0, 8)
    device = DeviceSpec("test", 1e11, 1e11, 1e10, alpha=links[0], link_bandwidth=1 / links[1], mesh_links=(links,))
    plan = dpar.plan(seeded_model(case), (x0,), mesh_shape=(world_size,), mesh_dim_names=roles, device=device)
    return plan.strategy, plan.sequence_parallel, plan.tp_dims(), train_parallel(rank, world_size, case, "fsdp", plan=plan)


def test_a_tensor_parallel_plan_from_the_planner_applies_and_matches() -> None:
    """On a slow device with a fast link the planner splits the tiny GPT's layers, the norms and residuals by
    sequence (sequence parallel), and that plan trains like one process. (On the default H100 constants it is too
    small to split.)"""
    case = Case("gpt", "sgd")
    strategy, sequence_parallel, dims, parallel = run_ranks(train_planned, 2, case, ("tp",), (1e-7, 1e-12))[0]
    split = sorted(name for name, dim in dims.items() if dim is not None)
    diff = max_abs_diff(parallel, single_process(case))
    print(f"planned {strategy} (slow device, fast link) splits {len(split)} parameters: max |difference| {diff:.2e}")
    assert strategy == "tp" and sequence_parallel
    assert {"blocks.0.attn.q.weight", "blocks.0.mlp.up.weight", "tok_emb.weight"} <= set(split)
    assert diff <= TOLERANCE["sgd"]


def test_auto_plans_then_parallelizes() -> None:
    case = Case("mlp", "adamw")
    parallel = run_ranks(train_parallel, 2, case, "auto")[0]
    assert max_abs_diff(parallel, single_process(case)) <= TOLERANCE["adamw"]
