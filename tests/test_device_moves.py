"""A dtype move after ``dpar.parallelize`` (``model.double()``, ``.to(torch.float64)``, ``.float()``), what Hugging
Face's Trainer and Lightning do to the model they are given: dpar's state follows the tensors, and training
equals torch DDP's on the same moved model."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import run_ranks

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "tp")
MOVES = {"double": lambda m: m.double(), "to_float64": lambda m: m.to(torch.float64)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 32, (4, 6), generator=g)


def _train(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    import dpar

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens, target = _batch(step, rank)
        optimizer.zero_grad()
        F.cross_entropy(model(tokens).flatten(0, 1), target.flatten()).backward()
        optimizer.step()
    state = dpar.checkpoint.full_state_dict(model)  # rank 0's; None on the others
    return {} if state is None else {k: v.detach().clone() for k, v in state.items()}


def _moved_after_parallelize(rank: int, world_size: int) -> dict[str, float]:
    import dpar

    worst = {}
    for move_name, move in MOVES.items():
        reference = nn.parallel.DistributedDataParallel(move(_model()))
        expected = {k.removeprefix("module."): v for k, v in _train(reference, rank).items()}
        for strategy in STRATEGIES:
            torch._dynamo.reset()
            model = _model()
            example = (torch.zeros(4, 6, dtype=torch.long),) if strategy == "tp" else None
            dpar.parallelize(model, strategy=strategy, example_inputs=example)
            move(model)
            compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
            got = _train(compiled, rank)
            assert all(v.dtype == torch.float64 for v in got.values()), (strategy, move_name)
            assert got.keys() == expected.keys(), (strategy, move_name)
            worst[f"{strategy} {move_name}"] = max((got[k] - expected[k]).abs().max().item() for k in expected) if got else 0.0
    return worst


def test_a_dtype_move_after_parallelize_trains_as_torch_ddp() -> None:
    worst = run_ranks(_moved_after_parallelize, 2, timeout_s=400)[0]  # rank 0 holds the full state
    assert len(worst) == len(STRATEGIES) * len(MOVES)
    assert all(diff < 1e-10 for diff in worst.values()), worst


def _train_on_fake_world(model: nn.Module, device: str) -> tuple[list[float], nn.Module, torch.optim.Optimizer]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    losses = []
    for step in range(2):
        tokens, target = (t.to(device) for t in _batch(step, 0))
        optimizer.zero_grad()
        loss = F.cross_entropy(compiled(tokens).flatten(0, 1), target.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model, optimizer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_cuda_move_after_parallelize_trains_on_the_gpu(strategy: str) -> None:
    """``model.cuda()`` after ``parallelize`` (what Trainer and Lightning do): every parameter, shard and
    optimizer state is on the GPU and the step runs there. One GPU stands in for rank 0 of 2 on the fake
    process group (its collectives return at once), so where no collective writes a tensor the rank reads
    (ddp: gradients are averaged in place; tp's partial sums) the losses equal those of a model moved
    before ``parallelize``; sharded strategies read gathered parameters the fake group leaves unwritten."""
    import dpar
    from fake_world import fake_world

    example = (torch.zeros(4, 6, dtype=torch.long),) if strategy == "tp" else None
    with fake_world(2):
        moved_after = dpar.parallelize(_model(), strategy=strategy, example_inputs=example).cuda()
        after, model, optimizer = _train_on_fake_world(moved_after, "cuda")
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        assert all(p.is_cuda for p in local), strategy
        assert all(v.is_cuda for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()), strategy
    if strategy in ("ddp", "tp"):
        with fake_world(2):
            cuda_example = None if example is None else tuple(t.cuda() for t in example)
            before, _, _ = _train_on_fake_world(
                dpar.parallelize(_model().cuda(), strategy=strategy, example_inputs=cuda_example), "cuda")
        assert after == pytest.approx(before, rel=1e-6), (strategy, after, before)
