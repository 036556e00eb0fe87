"""Numerics: tp on 2 and 4 gloo ranks, ddp+tp and fsdp+tp on 2x2, against one process on the whole batch."""

from __future__ import annotations

import pytest

from distributed import run_ranks
from tensor_parallel_training import single_process, train_parallel
from training import TOLERANCE, Case, max_abs_diff

CONFIGS = [
    ("tp", 2, "mlp", "sgd"),
    ("tp", 2, "mlp", "adamw"),
    ("tp", 2, "gpt", "sgd"),
    ("tp", 2, "gpt", "adamw"),
    ("tp", 4, "mlp", "adamw"),
    ("tp", 4, "gpt", "adamw"),  # 2 heads over 4 ranks: attention runs gathered, the rest split
    ("fsdp+tp", 4, "mlp", "sgd"),
    ("fsdp+tp", 4, "mlp", "adamw"),
    ("fsdp+tp", 4, "gpt", "sgd"),
    ("fsdp+tp", 4, "gpt", "adamw"),
    ("ddp+tp", 4, "gpt", "adamw"),
    ("zero2+tp", 4, "gpt", "sgd"),
]


@pytest.mark.parametrize("strategy,world,model,optimizer", CONFIGS, ids=["-".join(map(str, c)) for c in CONFIGS])
def test_matches_one_process_on_the_whole_batch(strategy: str, world: int, model: str, optimizer: str) -> None:
    case = Case(model, optimizer)
    parallel = run_ranks(train_parallel, world, case, strategy)[0]
    diff = max_abs_diff(parallel, single_process(case))
    print(f"{strategy} at {world} ranks, {case.id}: max |difference| {diff:.2e}")
    assert diff <= TOLERANCE[optimizer]
