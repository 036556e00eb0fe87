"""Numerics: dpar on 2 and 3 gloo ranks against torch DDP and one process on the whole batch.

Every rank builds its model from a different seed, so agreement also shows that
rank 0's parameters were broadcast at the first compile.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distributed import run_ranks
from training import (
    CASES,
    HAS_BATCHNORM,
    TOLERANCE,
    BUILDERS,
    Case,
    max_abs_diff,
    seeded_model,
    single_process_reference,
    train,
)


def rank_main(rank: int, world_size: int, cases: list[Case]) -> dict:
    import dpar

    results = {}
    for case in cases:
        torch._dynamo.reset()
        torch.manual_seed(rank)  # different on every rank: dpar must broadcast rank 0's
        model = BUILDERS[case.model]()
        # Several buckets per model: the pass is exercised, not just one flat all-reduce.
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager", "bucket_cap_mb": 0.01})
        got = train(case, model, compiled, rank, world_size, lambda: dpar.no_sync(compiled))

        torch.manual_seed(rank)
        reference = BUILDERS[case.model]()
        ddp = nn.parallel.DistributedDataParallel(reference, find_unused_parameters=case.model == "frozen_unused")
        want = train(case, reference, ddp, rank, world_size, ddp.no_sync)
        results[case.id] = {"dpar": got, "ddp": want}
    return results


# 3 ranks (an odd ring) by `-m extended`.
@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.extended)], ids=lambda n: f"{n}ranks")
def trained(request) -> tuple[int, list[dict]]:
    world_size = request.param
    return world_size, run_ranks(rank_main, world_size, CASES, timeout_s=600)


def compared(case: Case, state: dict) -> dict:
    """What must equal DDP on every rank.

    Parameters the captured graphs never read (``unused.*``) are not broadcast by
    dpar, so only rank 0 holds DDP's values for them (README: Semantics). Buffers
    are compared unless ``no_sync`` ran: DDP skips the buffer broadcast in the
    forward after a no_sync one, dpar broadcasts in every forward (README).
    """
    keep = {n for n, _ in seeded_model(case).named_parameters() if not n.startswith("unused.")}
    if case.micro_batches == 1:
        keep |= {n for n, _ in seeded_model(case).named_buffers()}
    return {k: v for k, v in state.items() if k in keep}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parameters_match_torch_ddp(trained, case: Case) -> None:
    world_size, per_rank = trained
    tolerance = TOLERANCE[case.optimizer]
    # Rank 0 is where broadcasts come from: there everything equals DDP.
    assert max_abs_diff(per_rank[0][case.id]["dpar"], per_rank[0][case.id]["ddp"]) <= tolerance
    for rank, result in enumerate(per_rank[1:], start=1):
        got, want = result[case.id]["dpar"], result[case.id]["ddp"]
        assert max_abs_diff(compared(case, got), compared(case, want)) <= tolerance, f"rank {rank}"
    # Replicas hold the same parameters (buffers stay rank-local after each forward's update).
    trained_names = [n for n, _ in seeded_model(case).named_parameters() if not n.startswith("unused.")]
    first, last = per_rank[0][case.id]["dpar"], per_rank[-1][case.id]["dpar"]
    assert max(((first[n] - last[n]).abs().max().item() for n in trained_names)) <= 1e-6
    # Training moved the parameters: the comparison is not between two untouched models.
    initial = seeded_model(case).state_dict()
    assert max_abs_diff(per_rank[0][case.id]["dpar"], initial) > 10 * tolerance


@pytest.mark.parametrize("case", [c for c in CASES if c.model not in HAS_BATCHNORM], ids=lambda c: c.id)
def test_parameters_match_single_process_on_whole_batch(trained, case: Case) -> None:
    world_size, per_rank = trained
    want = single_process_reference(case, seeded_model(case), world_size)
    assert max_abs_diff(per_rank[0][case.id]["dpar"], want) <= TOLERANCE[case.optimizer]


def varying_batches(rank: int, world_size: int) -> dict:
    """Batch sizes that change (a recompile, then dynamic shapes): dpar against DDP."""
    import dpar
    import torch.nn.functional as F

    from models import MLP

    from dpar.compiler.registry import recording

    states = {}
    for mode in ("dpar", "ddp"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MLP()
        runner = (
            torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
            if mode == "dpar"
            else nn.parallel.DistributedDataParallel(model)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with recording() as graphs:
            for step, rows in enumerate([4, 4, 6, 6, 3, 5]):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(rows * world_size, 16, generator=g), torch.randn(rows * world_size, 4, generator=g)
                opt.zero_grad()
                F.mse_loss(runner(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
                opt.step()
        states[mode] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if mode == "dpar":
            states["backward graphs"] = sum(1 for c in graphs if c.label.startswith("backward"))
    return states


def test_recompiles_for_new_batch_sizes_keep_matching_ddp() -> None:
    per_rank = run_ranks(varying_batches, 2, timeout_s=300)
    for result in per_rank:
        assert max_abs_diff(result["dpar"], result["ddp"]) <= TOLERANCE["sgd"]
    # The second batch size recompiles once with a dynamic batch dimension, then no more.
    assert per_rank[0]["backward graphs"] == 2
