"""A model whose pipeline costs can be worked out by hand, for the inspection and planner tests.

``Stack``: ``BLOCKS`` bias-free ``Linear(WIDTH, WIDTH)`` in ``blocks``, applied to ``(rows, SEQ,
WIDTH)`` fp32 inputs, with a mean-squared-error loss. On ``FLOPS_ONLY`` (1 GFLOP/s, infinite
memory and link bandwidth, no latency) a block's forward is exactly ``2 x rows x SEQ x WIDTH^2``
FLOPs = ns, sends cost nothing and every stage of one block costs the same.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpar.compiler.costs import DeviceSpec

BLOCKS, SEQ, WIDTH = 4, 8, 16
FLOPS_ONLY = DeviceSpec("flops-only", 1e9, 1e9, float("inf"), alpha=0.0, link_bandwidth=float("inf"))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def stack(rows: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model and ``(x, target)`` of ``rows`` rows: a ``dpar inspect`` / ``dpar plan`` target (with ``--loss``)."""
    torch.manual_seed(0)
    return Stack(), (torch.randn(rows, SEQ, WIDTH), torch.randn(rows, SEQ, WIDTH))
