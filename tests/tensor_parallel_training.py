"""Training under tp / ddp+tp / fsdp+tp on gloo ranks, for the numerics and structure tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dpar
from dpar.core.plan import AxisRole
from dpar.placement import plan_of
from training import STEPS, Case, global_batch, loss_of, make_optimizer, seeded_model

ROWS = 8  # global batch


def compiled_tp_mlp(rank: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The smallest tensor-parallel run: the MLP under tp, compiled with aot_eager, and this rank's (x, y)."""
    from models import MLP

    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    dpar.parallelize(model, strategy="tp", example_inputs=(x,))
    return torch.compile(model, backend="dpar", options={"compiler": "aot_eager"}), x, y


def mesh_of(strategy: str, world_size: int):
    if strategy == "tp":
        return init_device_mesh("cpu", (world_size,))
    return init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))


def data_parallel_rank(model: torch.nn.Module, world_size: int, same_batch_in_tp_group: bool) -> tuple[int, int]:
    """(rank, size) of this process among the ranks fed different rows: every rank (DDP's contract),
    or, for a user who feeds a tensor-parallel group one batch, the group's position on the dp axis."""
    chosen = plan_of(model)
    if not same_batch_in_tp_group:
        return dist.get_rank(), world_size
    tp = chosen.axis(AxisRole.TENSOR).size
    return dist.get_rank() // tp, world_size // tp


def train_parallel(
    rank: int, world_size: int, case: Case, strategy: str, compiler: str = "aot_eager",
    step_context: Callable[[int], contextlib.AbstractContextManager] | None = None, **parallelize_kwargs
) -> dict:
    """``case`` trained under ``strategy``, each rank fed its own rows, each step inside ``step_context(step)``
    where given (a profiler around one); the full state dict on rank 0."""
    model = seeded_model(case)
    x0, _ = global_batch(case.model, 0, 0, ROWS)
    if strategy in ("tp", "ddp+tp", "zero2+tp", "fsdp+tp"):
        parallelize_kwargs["mesh"] = mesh_of(strategy, world_size)
    dpar.parallelize(model, strategy=strategy, example_inputs=(x0,), **parallelize_kwargs)
    runner = torch.compile(model, backend="dpar", options={"compiler": compiler})
    opt = make_optimizer(case.optimizer, [p for p in model.parameters() if p.requires_grad])
    same_batch = parallelize_kwargs.get("same_batch_in_tp_group", False)
    dp_rank, dp_size = data_parallel_rank(model, world_size, same_batch)
    for step in range(STEPS):
        with step_context(step) if step_context is not None else contextlib.nullcontext():
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
