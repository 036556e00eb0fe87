"""Training under tp / ddp+tp / fsdp+tp on gloo ranks, for the numerics and structure tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dpar
from training import STEPS, Case, global_batch, loss_of, make_optimizer, seeded_model

ROWS = 8  # global batch


def mesh_of(strategy: str, world_size: int):
    if strategy == "tp":
        return init_device_mesh("cpu", (world_size,))
    return init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))


def train_parallel(rank: int, world_size: int, case: Case, strategy: str, compiler: str = "aot_eager") -> dict:
    """``case`` trained under ``strategy``; returns the full state dict (rank 0) and collective counts."""
    mesh = mesh_of(strategy, world_size)
    model = seeded_model(case)
    x0, _ = global_batch(case.model, 0, 0, ROWS)
    dpar.parallelize(model, strategy=strategy, mesh=mesh, example_inputs=(x0,))
    runner = torch.compile(model, backend="dpar", options={"compiler": compiler})
    opt = make_optimizer(case.optimizer, [p for p in model.parameters() if p.requires_grad])
    dp_size = 1 if strategy == "tp" else mesh["dp"].size()
    dp_rank = 0 if strategy == "tp" else mesh["dp"].get_local_rank()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(case.model, step, 0, ROWS)
        loss_of(case.model, runner, x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]).backward()
        opt.step()
    return dpar.checkpoint.full_state_dict(model)


def single_process(case: Case) -> dict:
    model = seeded_model(case)
    opt = make_optimizer(case.optimizer, [p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(case.model, step, 0, ROWS)
        loss_of(case.model, model, x, y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
