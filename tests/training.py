"""What the numerics tests share: models by name, deterministic batches, the training loop."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import MLP, ConvBN, FrozenAndUnused, GraphBreak, Uneven

STEPS = 5
# Tolerances from ../shared/design/NOTES.md: Adam amplifies fp32 reduction-order noise.
TOLERANCE = {"sgd": 1e-5, "adamw": 1e-4}


def tiny_gpt() -> nn.Module:
    from gpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=32, fused_qkv=False))


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    optimizer: str
    micro_batches: int = 1  # > 1: all but the last inside no_sync

    @property
    def id(self) -> str:
        return f"{self.model}-{self.optimizer}" + (f"-accumulate{self.micro_batches}" if self.micro_batches > 1 else "")


BUILDERS = {
    "mlp": MLP,
    "convbn": ConvBN,
    "gpt": tiny_gpt,
    "frozen_unused": FrozenAndUnused,
    "graph_break": GraphBreak,
    "uneven": Uneven,
}
HAS_BATCHNORM = {"convbn"}

CASES = [Case(m, o) for m in BUILDERS for o in ("sgd", "adamw")] + [
    Case("mlp", "sgd", 4),
    Case("gpt", "adamw", 4),
    Case("graph_break", "sgd", 4),
    Case("convbn", "sgd", 4),
]


def global_batch(model: str, step: int, micro: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    if model == "gpt":
        tokens = torch.randint(0, 256, (rows, 17), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if model == "convbn":
        return torch.randn(rows, 3, 8, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)


def loss_of(model_name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if model_name == "gpt":
        return model(x, y)
    out = model(x)
    return F.cross_entropy(out, y) if model_name == "convbn" else F.mse_loss(out, y)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def train(
    case: Case,
    model: nn.Module,
    runner: nn.Module,
    rank: int,
    world_size: int,
    no_sync,
    optimizers: list[torch.optim.Optimizer] | None = None,
) -> dict:
    """Train ``model`` through ``runner``; the optimizer is appended to ``optimizers`` if given."""
    opt = make_optimizer(case.optimizer, [p for p in model.parameters() if p.requires_grad])
    if optimizers is not None:
        optimizers.append(opt)
    rows_per_rank = 4
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(case.micro_batches):
            x, y = global_batch(case.model, step, micro, rows_per_rank * world_size)
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            last = micro == case.micro_batches - 1
            with no_sync() if not last else contextlib.nullcontext():
                loss_of(case.model, runner, x, y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def single_process_reference(case: Case, model: nn.Module, world_size: int) -> dict:
    """One process on the whole batch: the global mean loss, micro-batches summed."""
    opt = make_optimizer(case.optimizer, [p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(case.micro_batches):
            x, y = global_batch(case.model, step, micro, 4 * world_size)
            loss_of(case.model, model, x, y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def seeded_model(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return BUILDERS[case.model]()
