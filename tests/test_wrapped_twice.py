"""A dpar-compiled model inside torch's DDP, or holding DTensors torch placed, is refused by name at its
first step (see [Note: wrapped twice] in compiler/wrapped_twice.py), never reduced twice in silence; a model
``dpar.parallelize`` placed is refused already by DDP's constructor, before it would broadcast rank 0's parts over
every rank's (Hugging Face's plain Trainer: tests/test_integration_transformers.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from distributed import run_ranks


def _wrapped_twice(rank: int, world_size: int) -> dict[str, str]:
    import dpar
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    outcomes = {}
    for wrapper in ("none", "ddp", "torch_tp"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        if wrapper == "ddp":  # what Hugging Face's Trainer does to the model it is given, under torchrun
            runner = nn.parallel.DistributedDataParallel(compiled)
        elif wrapper == "torch_tp":  # DTensor parameters placed by torch, not dpar
            mesh = init_device_mesh("cpu", (world_size,))
            parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            runner = compiled
        else:
            runner = compiled
        try:
            runner(torch.randn(4, 8)).sum().backward()
            outcomes[wrapper] = "ran"
        except dpar.WrappedTwiceError as e:
            outcomes[wrapper] = str(e)
    for strategy in ("fsdp", "tp"):  # a placed model wrapped by DDP's constructor: refused before it broadcasts
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        dpar.parallelize(model, strategy=strategy, tp_plan={"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None}
                         if strategy == "tp" else None)
        before = dpar.checkpoint.full_state_dict(model)
        try:
            nn.parallel.DistributedDataParallel(model)
            outcomes[f"ddp around {strategy}"] = "wrapped"
        except dpar.WrappedTwiceError as e:
            outcomes[f"ddp around {strategy}"] = str(e)
        after = dpar.checkpoint.full_state_dict(model)
        outcomes[f"{strategy} unchanged"] = before is None or all(torch.equal(before[k], after[k]) for k in before)
    return outcomes


def test_a_dpar_model_inside_ddp_or_fsdp2_is_refused_by_name() -> None:
    for outcomes in run_ranks(_wrapped_twice, 2, timeout_s=300):
        assert outcomes["none"] == "ran"
        assert "inside torch.nn.parallel.DistributedDataParallel (Sequential wrapped by" in outcomes["ddp"], outcomes["ddp"]
        assert "reduced twice" in outcomes["ddp"]
        assert "DTensors dpar did not place" in outcomes["torch_tp"] and "parallelize_module" in outcomes["torch_tp"], outcomes["torch_tp"]
        for wrapped in ("ddp around fsdp", "ddp around tp"):
            assert outcomes[wrapped].startswith("a model dpar.parallelize placed is being wrapped in torch.nn.parallel"
                                                ".DistributedDataParallel"), (wrapped, outcomes[wrapped])
            assert "DparTrainer" in outcomes[wrapped]
        assert outcomes["fsdp unchanged"] and outcomes["tp unchanged"]
