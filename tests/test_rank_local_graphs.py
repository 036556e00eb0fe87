"""Evaluation on rank 0 only between training steps: the loop torch DDP runs.

Under ddp a no_grad forward compiles a graph without collectives, which runs on
rank 0 without waiting for anyone; the parameters then equal DDP's. Under zero2
and fsdp even a forward gathers sharded parameters, so rank 0 alone cannot run
it, nor under tp, where the forward's layers are split: it raises a named error
within seconds instead of waiting out the check's timeout.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import run_ranks

ROWS_PER_RANK = 2
TRAIN_STEPS = (0, 1, 2, 3)  # evaluation on rank 0 after the second
SGD_TOLERANCE = 1e-5
# Rank 0 knows about 2 s after reaching the check (one second before asking, answers polled once a
# second, two answers); compiling the eval graph before it takes longer on a busy 2-core machine.
# The check's own timeout is 120 s.
CHECK_WAIT_WITHIN_S = 10.0
ERROR_WITHIN_S = 60.0


def _build(name: str) -> nn.Module:
    from models import ConvBN
    from third_party import build
    from training import tiny_gpt

    torch.manual_seed(0)
    if name == "gpt2":
        return build("gpt2")
    return tiny_gpt() if name == "tiny_gpt" else ConvBN()


def _batch(name: str, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """This rank's slice of the step's global batch."""
    import third_party
    import training

    rows = ROWS_PER_RANK * world_size
    if name == "gpt2":
        batch = third_party.global_batch(step, rows)
    else:
        batch = training.global_batch("gpt" if name == "tiny_gpt" else "convbn", step, 0, rows)
    return third_party.rank_slice(batch, rank, world_size)


def _loss(name: str, runner: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if name == "convbn":
        x, y = batch
        return F.cross_entropy(runner(x), y)
    return runner(*batch)  # tiny GPT and the Hugging Face wrapper return their loss


def _evaluate(name: str, model: nn.Module, runner: nn.Module, rank: int, world_size: int) -> float:
    """Rank 0's evaluation: eval mode, no_grad, forward only, on a batch training never sees."""
    model.eval()
    with torch.no_grad():
        loss = _loss(name, runner, _batch(name, 100, rank, world_size)).item()
    model.train()
    return loss


def _train_evaluate_train(name: str, model: nn.Module, runner: nn.Module, rank: int, world_size: int) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    result: dict = {}
    for step in TRAIN_STEPS:
        if step == 2 and rank == 0:
            result["eval_loss"] = _evaluate(name, model, runner, rank, world_size)
        opt.zero_grad()
        _loss(name, runner, _batch(name, step, rank, world_size)).backward()
        opt.step()
    result["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


def _ddp_against_torch_ddp(rank: int, world_size: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        torch._dynamo.reset()
        model = _build(name)
        runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        dpar_result = _train_evaluate_train(name, model, runner, rank, world_size)
        model = _build(name)
        torch_result = _train_evaluate_train(name, model, nn.parallel.DistributedDataParallel(model), rank, world_size)
        results[name] = {"dpar": dpar_result, "torch_ddp": torch_result}
    return results


def test_rank0_evaluation_between_ddp_steps_runs_alone_and_matches_torch_ddp() -> None:
    """tiny GPT, Hugging Face GPT-2 (no buffers) and BatchNorm (buffers; a no_grad graph does not broadcast them)."""
    names = ["tiny_gpt", "gpt2", "convbn"]
    per_rank = run_ranks(_ddp_against_torch_ddp, 2, names, timeout_s=300)
    for name in names:
        assert per_rank[0][name]["dpar"]["eval_loss"] == pytest.approx(
            per_rank[0][name]["torch_ddp"]["eval_loss"], abs=SGD_TOLERANCE
        ), name
        for rank, result in enumerate(per_rank):
            got, want = result[name]["dpar"]["state"], result[name]["torch_ddp"]["state"]
            assert got.keys() == want.keys()
            diff = max((got[k].double() - want[k].double()).abs().max().item() for k in got)
            print(f"{name} rank {rank}: max |dpar - torch DDP| = {diff:.2e}")
            assert diff <= SGD_TOLERANCE, (name, rank, diff)


def _sharded_rank0_evaluation(rank: int, world_size: int, strategy: str) -> dict:
    import dpar

    model = _build("tiny_gpt")
    example = _batch("tiny_gpt", 0, rank, world_size) if strategy == "tp" else None
    dpar.parallelize(model, strategy=strategy, example_inputs=example)
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager", "check_timeout_s": 120})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in TRAIN_STEPS:
        if step == 2 and rank == 0:
            start = time.monotonic()
            try:
                _evaluate("tiny_gpt", model, runner, rank, world_size)
            except dpar.CollectiveMismatchError as exc:
                return {"error": type(exc).__name__, "message": str(exc), "elapsed_s": time.monotonic() - start}
            return {"error": None}
        opt.zero_grad()
        try:
            _loss("tiny_gpt", runner, _batch("tiny_gpt", step, rank, world_size)).backward()
        except RuntimeError as exc:  # rank 1 waits in step 2's all-gather until rank 0 leaves
            return {"error": type(exc).__name__, "step": step}
        opt.step()
    return {"error": None}


# zero2 gathers nothing in the forward: fsdp's and tp's graphs are the ones a lone rank would block in (tp's by
# `-m extended`: the check that names the diverged rank is the same).
@pytest.mark.parametrize("strategy", [pytest.param("zero2", marks=pytest.mark.extended), "fsdp",
                                      pytest.param("tp", marks=pytest.mark.extended)])
def test_rank0_evaluation_under_sharding_raises_a_named_error_within_seconds(strategy: str) -> None:
    rank0, rank1 = run_ranks(_sharded_rank0_evaluation, 2, strategy, timeout_s=180)
    assert rank0["error"] == "DivergedRanksError", rank0
    message = rank0["message"]
    waited_s = float(re.search(r"will not come \(seen after ([0-9.]+) s\)", message).group(1))
    print(f"{strategy}: {waited_s:.1f} s at the check, {rank0['elapsed_s']:.1f} s with compiling\n{message}")
    assert waited_s < CHECK_WAIT_WITHIN_S
    assert rank0["elapsed_s"] < ERROR_WITHIN_S
    assert "rank(s) [1] will not come" in message
    assert "test_rank_local_graphs.py:" in message and "in _loss -> gpt.py:" in message  # where rank 1 waits
    assert "run the evaluation on every rank" in message
    assert "dpar.checkpoint.full_state_dict(model)" in message
    assert rank1 == {"error": "RankLostError", "step": 2}  # rank 0, the store's host, left: runtime/liveness.py


def _late_rank(rank: int, world_size: int, late_s: float) -> float:
    torch.manual_seed(0)
    model = torch.compile(nn.Linear(4, 4), backend="dpar", options={"compiler": "aot_eager", "check_timeout_s": 60})
    if rank == 1:
        time.sleep(late_s)  # data loading, say: no collective issued meanwhile
    start = time.monotonic()
    model(torch.randn(2, 4)).sum().backward()
    return time.monotonic() - start


def test_a_late_rank_is_waited_for_not_mistaken_for_a_diverged_one() -> None:
    """Rank 0 asks the late rank several times; it has issued no extra collective, so rank 0 keeps waiting."""
    late_s = 6.0
    waited_s, _ = run_ranks(_late_rank, 2, late_s, timeout_s=120)
    assert waited_s > late_s - 1.0
