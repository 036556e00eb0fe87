"""The models the numerics tests train: each stresses one part of the DDP pass."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvBN(nn.Module):
    """BatchNorm: running statistics are buffers, broadcast from rank 0 as DDP does.

    The convolutions have no bias: BatchNorm removes it, so its gradient would be
    pure rounding noise, which Adam turns into full-size steps that no two
    reduction orders agree on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class FrozenAndUnused(nn.Module):
    """A frozen layer (no gradient at all) and a layer forward never reads (no gradient either)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 32)
        self.frozen.requires_grad_(False)
        self.trained = nn.Linear(32, 4)
        self.unused = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(torch.tanh(self.frozen(x)))


class GraphBreak(nn.Module):
    """Two graphs; ``shared`` runs in both, so its gradient comes from two backward graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.middle = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.shared(x))
        x = torch.tanh(self.middle(x))
        torch._dynamo.graph_break()
        x = torch.tanh(self.shared(x))
        return self.head(x)


class Uneven(nn.Module):
    """Sizes no world size divides: shards need padding (and differ in shape across ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 30), nn.GELU(), nn.Linear(30, 5), nn.GELU(), nn.Linear(5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
