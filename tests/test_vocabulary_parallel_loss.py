"""The cross-entropy over a vocabulary-split LM head ([Note: a loss over a split vocabulary]) against one process:
a vocabulary two ranks split unevenly, an ignore index inside one rank's block, each reduction, label smoothing."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import run_ranks
from training import max_abs_diff

VOCAB, WIDTH, STEPS = 37, 16, 3  # 37 classes over 2 ranks: blocks of 19 and 18
IGNORED = 2  # a class of rank 0's block, and the local index of class 21 in rank 1's
LOSSES = {
    "mean": dict(ignore_index=IGNORED),
    "sum": dict(ignore_index=IGNORED, reduction="sum"),
    "smoothed": dict(label_smoothing=0.1),
}


class Head(nn.Module):
    def __init__(self, loss: dict) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.loss = loss

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(ids)))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), **self.loss)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (4, 6), generator=g)
    targets = torch.randint(0, VOCAB, (4, 6), generator=g)
    targets[:, ::3] = IGNORED  # ignored targets, beside valid ones of every class
    targets[0, 1] = 19 + IGNORED  # valid, though rank 1 numbers it as the ignored class
    return ids, targets


def train(name: str, parallel: bool) -> dict[str, torch.Tensor]:
    import dpar

    torch.manual_seed(0)
    model = Head(LOSSES[name])
    runner = model
    if parallel:
        dpar.parallelize(model, strategy="tp", example_inputs=batch(0), same_batch_in_tp_group=True,
                         tp_plan={"embed.weight": None, "head.weight": 0})
        runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        runner(*batch(step)).backward()
        opt.step()
    return dpar.checkpoint.full_state_dict(model) if parallel else {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_every_loss(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    return {name: train(name, parallel=True) for name in LOSSES}


def test_each_loss_over_a_split_vocabulary_matches_one_process() -> None:
    parallel = run_ranks(train_every_loss, 2, timeout_s=300)[0]
    for name in LOSSES:
        diff = max_abs_diff(parallel[name], train(name, parallel=False))
        print(f"tp 2, cross-entropy {name}: max |difference| {diff:.2e}")
        assert diff <= 1e-6, name
