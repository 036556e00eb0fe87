"""Models the planner tests plan: built on the meta device, so no weights are allocated."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpar.compiler.costs import DeviceSpec

# Round numbers so known answers can be worked out by hand: 100 TFLOP/s, 1 TB/s,
# a fast link (α 1 µs, 100 GB/s) and a slow one (α 10 µs, 10 GB/s).
FAST = (1e-6, 1e-11)
SLOW = (1e-5, 1e-10)


def hardware(*links: tuple[float, float]) -> DeviceSpec:
    """A user-given device: 100 TFLOP/s in every dtype, 1 TB/s, one (α, β) per mesh dimension."""
    return DeviceSpec("test", 1e14, 1e14, 1e12, alpha=links[0][0], link_bandwidth=1 / links[0][1], mesh_links=tuple(links))


class MLP(nn.Module):
    """``layers`` square Linear layers with GELU between them, ending in a mean-squared loss."""

    def __init__(self, hidden: int, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.gelu(layer(x))
        return F.mse_loss(x, target)


class Fork(nn.Module):
    """One normalised tensor read by two Linear layers: their gradients meet before the norm."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.a, self.b, self.out = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return F.mse_loss(self.out(F.gelu(self.a(h)) + self.b(h)), target)


def fork(hidden: int, batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    with torch.device("meta"):
        return Fork(hidden), (torch.empty(batch, hidden), torch.empty(batch, hidden))


def mlp(hidden: int, batch: int, layers: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    with torch.device("meta"):
        return MLP(hidden, layers), (torch.empty(batch, hidden), torch.empty(batch, hidden))


def gpt(n_layer: int = 2, n_embd: int = 256, n_head: int = 8, block: int = 128, vocab: int = 4096, batch: int = 8):
    """examples/gpt.py's GPT on the meta device, with a batch of token ids and targets."""
    from gpt import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd, fused_qkv=False
    )
    with torch.device("meta"):
        model = GPT(config)
    ids = torch.zeros(batch, block, dtype=torch.long, device="meta")
    return model, (ids, torch.zeros(batch, block, dtype=torch.long, device="meta"))
