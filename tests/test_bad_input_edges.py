"""Bad input at the edges: batches whose shapes differ across ranks, nan/inf gradients (named under
options={"check_finite": True}), a model moved after compile, an optimizer over other parameters.

Each is a named error or the documented behaviour: one 2-rank run for the cases that recover (every
rank raises the same error, catches it and trains on), one for a batch that changes shape on one
rank only (that rank raises, the other fails when it leaves).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpar
from distributed import run_ranks
from models import MLP

pytestmark = pytest.mark.filterwarnings("ignore:dpar. no process group:UserWarning")


class TwoBranches(nn.Module):
    """``b.weight``'s gradient is ``m`` itself: an inf or nan in ``m`` reaches that gradient alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum() + (self.b.weight * m).sum()


def compiled(model: nn.Module, **options: object) -> nn.Module:
    return torch.compile(model, backend="dpar", options={"compiler": "aot_eager", **options})


def caught(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the test asserts the type by name
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def edges(rank: int, world_size: int) -> dict:
    results: dict = {}
    m_bad = torch.zeros(4, 8)
    m_bad[3, 5] = float("inf") if rank == 1 else 0.0  # row 3: rank 1's shard under fsdp
    for strategy in ("ddp", "fsdp"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TwoBranches() if strategy == "ddp" else dpar.parallelize(TwoBranches(), strategy="fsdp")
        runner = compiled(model, check_finite=True)
        x = torch.randn(2, 8)
        runner(x, torch.ones(4, 8)).backward()
        before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}  # b.bias: unused
        results[f"{strategy} inf"] = caught(lambda: runner(x, m_bad).backward())
        results[f"{strategy} grads kept"] = all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters() if n in before)
        nan_x = x.clone()
        nan_x[0, 0] = float("nan") if rank == 0 else 1.0
        results[f"{strategy} nan"] = caught(lambda: runner(nan_x, torch.ones(4, 8)).backward())
        runner(x, torch.ones(4, 8)).backward()  # every rank goes on after the error: no hang
        results[f"{strategy} went on"] = True

    # Shapes that differ from the first step: each rank compiles its own graph, the gradients are
    # averaged as torch DDP averages them (each rank's mean counts once).
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    runner = compiled(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        rows = 4 if rank == 0 else 3
        x, y = torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)
        for r, o in ((runner, opt), (reference, ref_opt)):
            o.zero_grad()
            F.mse_loss(r(x), y).backward()
            o.step()
    results["uneven rows vs ddp"] = max(
        (p - q).abs().max().item() for p, q in zip(model.parameters(), reference.module.parameters())
    )

    # Moved after compile: the recompile checks the devices again; another dtype just recompiles.
    results["moved to meta"] = caught(lambda: (model.to("meta"), runner(torch.randn(2, 16, device="meta"))))
    torch.manual_seed(0)
    model = MLP()
    runner = compiled(model)
    runner(torch.randn(2, 16)).sum().backward()
    model.to(torch.float64)
    model.zero_grad()
    runner(torch.randn(2, 16, dtype=torch.float64) * (rank + 1)).sum().backward()
    results["float64 grad"] = model.net[0].weight.grad.clone()
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(edges, 2, timeout_s=240)


def test_an_inf_gradient_in_one_ranks_shard_is_named_on_every_rank(ranks) -> None:
    for result in ranks:
        for strategy in ("ddp", "fsdp"):
            message = result[f"{strategy} inf"]
            assert message.startswith("NonFiniteGradientError: non-finite gradients in backward call #2"), message
            assert ": b.weight (inf). This graph's gradients were not stored" in message, message
            assert result[f"{strategy} grads kept"] and result[f"{strategy} went on"]


def test_a_nan_input_on_one_rank_names_every_parameter_it_reached(ranks) -> None:
    for result in ranks:
        for strategy in ("ddp", "fsdp"):
            message = result[f"{strategy} nan"]
            assert "NonFiniteGradientError" in message and "a.weight (nan)" in message, message
            assert "b.weight" not in message  # b's gradient is m alone: finite


def test_batches_of_different_sizes_on_each_rank_train_as_torch_ddp(ranks) -> None:
    assert ranks[0]["uneven rows vs ddp"] <= 1e-6


def test_a_model_moved_after_compile_is_checked_again_on_recompile(ranks) -> None:
    for result in ranks:
        # No values on meta: refused as a model born there is (UnmaterializedStateError names the parameter), before
        # the process group's device check would have said gloo needs cpu tensors.
        message = result["moved to meta"]
        assert message.startswith("UnmaterializedStateError: parameter net.0.weight is still on the meta device"), message
    # float64: recompiled, and the gradient is still averaged over the ranks.
    assert ranks[0]["float64 grad"].dtype == torch.float64
    assert torch.equal(ranks[0]["float64 grad"], ranks[1]["float64 grad"])


def batch_shrinks_on_one_rank(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    runner = compiled(MLP(), check_timeout_s=30)
    start = time.monotonic()
    try:
        for step in range(3):
            rows = 3 if rank == 1 and step == 2 else 4  # rank 1's last batch is short
            runner(torch.randn(rows, 16)).sum().backward()
    except Exception as exc:
        return f"{time.monotonic() - start:.1f} s {type(exc).__name__}: {exc}"
    return "no error"


def test_a_batch_that_changes_shape_on_one_rank_fails_fast_naming_the_recompile() -> None:
    rank0, rank1 = run_ranks(batch_shrinks_on_one_rank, 2, timeout_s=120)
    print(f"{rank0[:200]=}\n{rank1[:200]=}")
    assert "DivergedRanksError" in rank1 and "a recompile on one rank (a batch of another shape)" in rank1
    assert rank0 != "no error"  # blocked in the all-reduce rank 1 never joins, it fails when rank 1 leaves
    assert float(rank1.split(" s ")[0]) < 30 and float(rank0.split(" s ")[0]) < 30


def test_check_finite_names_the_parameter_in_one_process() -> None:
    torch._dynamo.reset()
    model = TwoBranches()
    runner = compiled(model, check_finite=True)
    m = torch.ones(4, 8)
    m[0, 0] = float("nan")
    with pytest.raises(dpar.NonFiniteGradientError, match=r"backward call #1 of this graph: b.weight \(nan\)\. "):
        runner(torch.randn(2, 8), m).backward()
    assert model.a.weight.grad is None


@pytest.mark.parametrize("bad", ["yes", 1])
def test_check_finite_must_be_a_bool(bad) -> None:
    with pytest.raises(ValueError, match="check_finite must be True or False"):
        compiled(MLP(), check_finite=bad)(torch.randn(2, 16))


def test_an_optimizer_over_other_parameters_leaves_the_model_as_pytorch_does_and_save_names_it(tmp_path) -> None:
    """Documented behaviour: as in plain PyTorch, the model does not train; dpar.checkpoint.save refuses it."""
    torch._dynamo.reset()
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stale = torch.optim.SGD(MLP().parameters(), lr=0.1)
    compiled(model)(torch.randn(2, 16)).sum().backward()
    stale.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(dpar.OptionsError, match="build the optimizer from model.parameters"):
        dpar.checkpoint.save(model, stale, str(tmp_path / "ckpt"))
