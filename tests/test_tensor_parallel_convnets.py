"""Convolutional nets with BatchNorm under tensor parallel, each rank fed its own rows, against torch DDP.

Under tp every rank of the group runs each rank's rows as that rank's own program
([Note: the data contract under tensor parallel] in compiler/passes/group_batch.py), so each
rank's BatchNorm takes its statistics over its own rows, with its own n in the unbiased
running_var, as under DDP. Where BatchNorm sees very few values per channel (the last stage
of a ResNet on small images: 2 rows x 1 x 1 per rank), statistics over the wrong rows or a
wrong n would change the running statistics by tens of percent: both models below have such a
layer, and the plan splits their classifier (the only Linear).

[Note: a BatchNorm over two values amplifies rounding]
The harness's ResNet at 32x32 images would end in BatchNorm over 2 values per channel per
rank. Normalising two values gives +-sqrt(v / (v + eps)) whatever they are, so the gradient
through it is O(eps / v), computed by cancellation in BatchNorm's backward and so mostly fp32
rounding; AdamW's first steps, lr * g / (|g| + eps), turn that noise into lr-sized steps of
layer4's convolutions, and every entry follows. Torch DDP is not stable there against itself:
computing only its classifier in float64 moves its parameters 1.1 after 5 AdamW steps at lr
1e-2 (0.5 at lr 1e-3, 6e-3 at lr 1e-4), the size of tp's difference (0.87; tp rounds the
classifier's input gradient as a sum of two partial sums). So the harness's ResNet takes 64x64
images (``third_party.IMAGE``), where its last stage sees 8 values per channel per rank: there the float64 classifier
moves torch DDP 2.1e-5 and tp is 1.5e-5 from it. The small model runs SGD, which does not
normalise the noise away from zero.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import dpar
import third_party
from distributed import run_ranks
from third_party import ROWS_PER_RANK, VOCAB, Run, global_batch, rank_slice, train

class PooledBN(nn.Module):
    """The ResNet's last stage in miniature: a strided 3x3 convolution from 2x2 to 1x1, BatchNorm over
    each rank's rows alone (2 values per channel), ReLU, a classifier that tp splits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        images = (ids.float() / VOCAB).view(-1, 2, 2, 2)
        logits = self.fc(torch.flatten(self.relu(self.bn(self.conv(images))), 1))
        return nn.functional.cross_entropy(logits, ids[:, 0] % 10)


CASES = (  # (model, optimizer, lr)
    ("pooled_bn", "sgd", 0.05),
    ("resnet", "adamw", 1e-2),  # the harness's optimizer and the lr
)


def _train_cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    """Each case under torch DDP and tp in these processes; rank 0 returns |difference| per entry."""
    third_party.OTHER_MODELS["pooled_bn"] = PooledBN
    results = {}
    for model, optimizer, lr in CASES:
        reference = train(rank, world_size, Run(model, "torch_ddp", optimizer=optimizer, lr=lr))
        torch._dynamo.reset()
        state = train(rank, world_size, Run(model, "tp", optimizer=optimizer, lr=lr))
        torch._dynamo.reset()
        if rank == 0:
            assert state.keys() == reference.keys()
            results[model] = {
                k: (reference[k].double() - state[k].double()).abs().max().item()
                for k in reference if reference[k].is_floating_point()
            }
    return results


def test_resnet_and_pooled_batch_norm_under_tp_match_torch_ddp() -> None:
    results = run_ranks(_train_cases, 2, timeout_s=600)[0]
    for model, diffs in results.items():
        worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
        print(f"{model} under tp: max |difference| from torch DDP over {len(diffs)} entries: {worst}")
    assert len(results["resnet"]) == 102  # 62 parameters, 40 BatchNorm buffers (running statistics)
    for model, diffs in results.items():
        assert max(diffs.values()) <= 1e-4, model


def test_each_copy_normalises_its_own_rows(world_of_two: list) -> None:
    """One process, fake group of 2: one BatchNorm per rank's copy, each over that rank's rows
    (ROWS_PER_RANK x 1 x 1 values per channel), and the running statistics this rank keeps are
    read from its own copy."""
    torch.manual_seed(0)
    model = PooledBN()
    batch = rank_slice(global_batch(0, 2 * ROWS_PER_RANK), 0, 2)
    dpar.parallelize(model, strategy="tp", example_inputs=batch)
    torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(*batch).backward()
    forward = next(c.graph for c in world_of_two if c.label.startswith("forward"))
    norms = [n for n in forward.graph.nodes if n.target is torch.ops.aten._native_batch_norm_legit_functional.default]
    assert [tuple(n.args[0].meta["val"].shape) for n in norms] == [(ROWS_PER_RANK, 8, 1, 1)] * 2
    picks = [n for n in forward.graph.nodes if n.target is torch.ops.dpar.pick_own.default]
    # running_mean and running_var (outputs 3 and 4 of each copy's BatchNorm), then the loss
    read = [{(a.args[0], a.args[1]) for a in p.args[0] if a.target.__name__ == "getitem"} for p in picks]
    assert read[:2] == [{(norms[0], 3), (norms[1], 3)}, {(norms[0], 4), (norms[1], 4)}]
    assert all(p.args[1] == 0 for p in picks)  # this rank (0)'s copy
