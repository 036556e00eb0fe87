"""A parallelized model whose training forward never reaches dpar's graphs is refused by name, never
trained on each rank's own gradients in silence (see [Note: a model that never reaches the backend] in
runtime/eager_guard.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from distributed import run_ranks

STEPS = 3


def _sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(runner: nn.Module, model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    import dpar

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        runner(_batch(step, rank)).square().mean().backward()
        opt.step()
    return dpar.checkpoint.full_state_dict(model) if not isinstance(runner, nn.parallel.DistributedDataParallel) else {
        k: v.detach().clone() for k, v in model.state_dict().items()}


def _outcomes(rank: int, world_size: int) -> dict[str, object]:
    import dpar

    reference = _train(nn.parallel.DistributedDataParallel(m := _sequential()), m, rank)
    found: dict[str, object] = {}
    for strategy in ("ddp", "fsdp"):
        # nn.Module.compile on an nn.Sequential: without parallelize's hook Dynamo compiles nothing (0 graphs)
        torch._dynamo.reset()
        model = dpar.parallelize(_sequential(), strategy=strategy)
        model.compile(backend="dpar", options={"compiler": "aot_eager"})
        state = _train(model, model, rank)
        if rank == 0:  # full_state_dict gathers onto rank 0
            found[f"{strategy} module.compile"] = max((state[k] - reference[k]).abs().max().item() for k in reference)
        # never compiled: refused at the first training forward, allowed under no_grad and in eval mode
        model = dpar.parallelize(_sequential(), strategy=strategy)
        try:
            model(_batch(0, rank)).sum().backward()
            found[f"{strategy} eager"] = "trained"
        except dpar.NotCompiledError as exc:
            found[f"{strategy} eager"] = str(exc)
        with torch.no_grad():
            model(_batch(0, rank))
        model.eval()
        model(_batch(0, rank))
    return found


def test_a_model_that_never_reaches_dpar_is_refused_and_module_compile_trains_as_ddp() -> None:
    for rank, found in enumerate(run_ranks(_outcomes, 2, timeout_s=300)):
        for strategy in ("ddp", "fsdp"):
            assert rank > 0 or found[f"{strategy} module.compile"] < 1e-6, found
            message = found[f"{strategy} eager"]
            assert f"Sequential, parallelized for '{strategy}', ran a training forward outside dpar's compiled graphs" in message, message
            assert "torch.compile(model, backend='dpar')" in message
