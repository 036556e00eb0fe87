"""Accelerate's own loop (``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``) with ``DparAccelerator``
trains like a plain ``Accelerator``, which wraps the model in torch DDP, under every strategy.

Two gloo ranks, the tiny HF Llama and rows of tests/test_integration_transformers.py. See [Note: why Accelerate
must not wrap a dpar model] in integrations/accelerate.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distributed import run_ranks
from test_integration_transformers import STRATEGIES, TOLERANCE, _max_diff, _parallelized, llama, rows

ACCUMULATE = 2
MICRO_BATCHES = 6


def _train(accelerator, model: nn.Module) -> tuple[str, list[bool], list[float]]:
    """AdamW over MICRO_BATCHES micro-batches of 2 rows per rank, ACCUMULATE per step, clipped at norm 1: the
    type of model ``prepare`` returned, whether each micro-batch's backward reduced (outside ``dpar.no_sync``),
    and each step's gradient norm before clipping."""
    from dpar.runtime.gradient_sync import inside_no_sync

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(rows(MICRO_BATCHES * 2 * accelerator.num_processes, 1), batch_size=2)
    runner, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    reduced, norms = [], []
    for batch in loader:
        with accelerator.accumulate(runner):
            reduced.append(not inside_no_sync(model.parameters()))
            accelerator.backward(runner(**batch).loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(runner.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
    return type(runner).__name__, reduced, norms


def _accelerator_against_ddp(rank: int, world_size: int) -> dict[str, object]:
    import accelerate
    import dpar
    from dpar.integrations.accelerate import DparAccelerator

    anchor = llama()
    wrapped = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    wrapper, _, anchor_norms = _train(wrapped, anchor)
    want = {k: v.detach().clone() for k, v in anchor.state_dict().items()}
    found: dict[str, object] = {"anchor_wrapped_in": wrapper, "anchor norms": anchor_norms}
    for strategy in STRATEGIES:
        torch._dynamo.reset()
        model = _parallelized(strategy)
        accelerator = DparAccelerator(
            cpu=True, gradient_accumulation_steps=ACCUMULATE, compile_options={"compiler": "aot_eager"}
        )
        found[f"{strategy} wrapped_in"], found[f"{strategy} reduced"], norms = _train(accelerator, model)
        found[f"{strategy} norms"] = max(abs(a - b) for a, b in zip(norms, anchor_norms, strict=True))
        got = dpar.checkpoint.full_state_dict(model)
        if rank == 0:
            found[strategy] = _max_diff(want, got)
    try:
        accelerator.save_state("unused")
    except dpar.OptionsError as e:
        found["save_state"] = str(e)
    return found


def test_dpar_accelerator_trains_like_accelerates_ddp_under_every_strategy() -> None:
    found = run_ranks(_accelerator_against_ddp, 2, timeout_s=600)[0]
    for key, value in found.items():
        print(f"{key}: {value}")
    assert found["anchor_wrapped_in"] == "DistributedDataParallel"  # the anchor is Accelerate's own DDP
    assert min(found["anchor norms"]) > 1.0, found  # so clipping at 1 scales every step
    for strategy in STRATEGIES:
        assert found[strategy] <= TOLERANCE, (strategy, found[strategy])
        assert found[f"{strategy} norms"] <= TOLERANCE, found  # the norm of all gradients, over both ranks
        assert found[f"{strategy} wrapped_in"] == "OptimizedModule", found  # torch.compile's, no DDP
        assert found[f"{strategy} reduced"] == [False, True] * (MICRO_BATCHES // ACCUMULATE), found
    assert "dpar.checkpoint.save(model, optimizer, path) on every rank" in found["save_state"]
