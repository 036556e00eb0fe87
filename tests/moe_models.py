"""A mixture-of-experts language model of our own, in Hugging Face's experts convention.

Each block routes every token to ``top_k`` of ``num_experts`` experts (softmax router, top-k weights
renormalized) and adds a Switch-style load-balancing loss. The experts module holds its weights as
``(num_experts, ...)`` parameters and takes ``(hidden_states, top_k_index, top_k_weights)``, computed
unlike Hugging Face's kernels: every expert on every token, masked by the routing (an id of
``num_experts`` or more selects nothing, as expert parallel's empty slots need).
"""

from __future__ import annotations

import torch
import torch.nn as nn


class Experts(nn.Module):
    def __init__(self, num_experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, hidden, width) / width**0.5)
        self.b_in = nn.Parameter(torch.zeros(num_experts, hidden))
        self.w_out = nn.Parameter(torch.randn(num_experts, width, hidden) / hidden**0.5)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            weight = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
            inner = nn.functional.gelu(hidden_states @ self.w_in[e].T + self.b_in[e])
            out = out + weight * (inner @ self.w_out[e].T)
        return out


class MoEBlock(nn.Module):
    def __init__(self, width: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = Experts(num_experts, width, 2 * width)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.norm(x).flatten(0, 1)
        probs = self.router(tokens).softmax(-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = self.experts(tokens, index, weights)
        chosen = nn.functional.one_hot(index, probs.shape[-1]).sum(1).to(probs.dtype)
        balance = probs.shape[-1] * (chosen.mean(0) * probs.mean(0)).sum()  # Switch Transformer's auxiliary loss
        return x + routed.view_as(x), balance


class OwnMoE(nn.Module):
    """Embedding, two MoE blocks, a head; the loss is the masked token cross entropy plus 0.01 x balance."""

    def __init__(self, vocab: int = 64, width: int = 32, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(MoEBlock(width, num_experts, top_k) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x, balance = self.embed(ids), 0.0
        for block in self.blocks:
            x, aux = block(x)
            balance = balance + aux
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100) + 0.01 * balance
