"""Numerics: dpar on 2 and 3 gloo ranks against torch DDP and one process on the whole batch.

Every rank builds its model from a different seed, so agreement also shows that
rank 0's parameters were broadcast at the first compile.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import run_ranks
from models import MLP, ConvBN, FrozenAndUnused, GraphBreak

STEPS = 5
# Tolerances from ../shared/design/NOTES.md: Adam amplifies fp32 reduction-order noise.
TOLERANCE = {"sgd": 1e-5, "adamw": 1e-4}


def tiny_gpt() -> nn.Module:
    from gpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    optimizer: str
    micro_batches: int = 1  # > 1: all but the last inside no_sync

    @property
    def id(self) -> str:
        return f"{self.model}-{self.optimizer}" + (f"-accumulate{self.micro_batches}" if self.micro_batches > 1 else "")


BUILDERS = {"mlp": MLP, "convbn": ConvBN, "gpt": tiny_gpt, "frozen_unused": FrozenAndUnused, "graph_break": GraphBreak}
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
    return torch.optim.AdamW(params, lr=1e-2)


def train(case: Case, model: nn.Module, runner: nn.Module, rank: int, world_size: int, no_sync) -> dict:
    opt = make_optimizer(case.optimizer, [p for p in model.parameters() if p.requires_grad])
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


def rank_main(rank: int, world_size: int, cases: list[Case]) -> dict:
    import dpar

    results = {}
    for case in cases:
        torch._dynamo.reset()
        torch.manual_seed(rank)  # different on every rank: dpar must broadcast rank 0's
        model = BUILDERS[case.model]()
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager", "bucket_cap_mb": 0.01})
        got = train(case, model, compiled, rank, world_size, lambda: dpar.no_sync(compiled))

        torch.manual_seed(rank)
        reference = BUILDERS[case.model]()
        ddp = nn.parallel.DistributedDataParallel(reference, find_unused_parameters=case.model == "frozen_unused")
        want = train(case, reference, ddp, rank, world_size, ddp.no_sync)
        results[case.id] = {"dpar": got, "ddp": want}
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def trained(request) -> tuple[int, list[dict]]:
    world_size = request.param
    return world_size, run_ranks(rank_main, world_size, CASES, timeout_s=600)


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


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parameters_match_torch_ddp(trained, case: Case) -> None:
    world_size, per_rank = trained
    tolerance = TOLERANCE[case.optimizer]
    for rank, result in enumerate(per_rank):
        got, want = result[case.id]["dpar"], result[case.id]["ddp"]
        assert max_abs_diff(got, want) <= tolerance, f"rank {rank}"
    # Replicas hold the same parameters. (Buffers stay rank-local after each forward's update,
    # as in DDP; a parameter the graph never reads is never sent, see README.)
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


def seeded_model(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return BUILDERS[case.model]()
