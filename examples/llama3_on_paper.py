"""Llama-3-8B, -70B and -405B on paper: inspect and plan them at 64 to 16,384 ranks, nothing allocated.

The models are Hugging Face's ``LlamaForCausalLM`` at Llama 3's sizes, built on the
meta device (no storage: 8B would be 32 GB of fp32 parameters), wrapped to return
their next-token loss; the example input is one row of 2048 tokens, also on meta.
``dpar inspect`` compiles them for N simulated ranks in one process and prices the
step on a device preset; ``dpar plan`` chooses placements for a mesh.

    dpar inspect examples/llama3_on_paper.py:llama3_8b -n 64 --strategy ddp --device h100
    dpar inspect examples/llama3_on_paper.py:llama3_8b -n 64 --strategy fsdp --device h100
    dpar inspect examples/llama3_on_paper.py:llama3_8b -n 64 --strategy zero2   # also tp, hsdp, fsdp+tp, auto
    dpar inspect examples/llama3_on_paper.py:llama3_70b -n 1024 --strategy fsdp --device h100
    dpar plan examples/llama3_on_paper.py:llama3_8b --per-rank --mesh-shape 64
    dpar plan examples/llama3_on_paper.py:llama3_8b --per-rank --mesh-shape 8,8
    dpar plan examples/llama3_on_paper.py:llama3_8b_pipeline --per-rank --mesh-shape 64 --pipeline \
        --device h100 --loss examples/llama3_on_paper.py:model_loss
    dpar plan examples/llama3_on_paper.py:llama3_70b_bf16_pipeline --per-rank --mesh-shape 512 --pipeline \
        --device h100 --memory-budget-gb 80 --loss examples/llama3_on_paper.py:model_loss   # pp x tp x dp
    dpar plan examples/llama3_on_paper.py:llama3_70b --per-rank --mesh-shape 1024
    dpar plan examples/llama3_on_paper.py:llama3_70b --per-rank --mesh-shape 64,8 --memory-budget-gb 80
    dpar plan examples/llama3_on_paper.py:llama3_405b --per-rank --mesh-shape 2048,8 --memory-budget-gb 80

With a memory budget the planner also chooses activation checkpointing (keep, selective or
full recomputation of every layer) and prints each policy's best plan beside the one chosen.

What to check the figures against, for AdamW in fp32 (P parameters, 4P bytes):
ddp holds 16P per rank and its ring all-reduce sends 2 (N - 1) / N * 4P bytes per
rank; fsdp holds 16P / N (plus the block gathered at the time) and sends
(N - 1) / N * 4P in each of the forward's all-gathers, the backward's re-gathers
(the layers; the root's embedding and head stay gathered from the forward) and
the reduce-scatter. ``--per-rank``: the example input is one rank's rows. Both price
compute on the same device (``--device``, default h100) in the model's own dtype (fp32
here: matmuls at the TF32 peak) with one FLOP count; ``dpar plan`` prices memory and
communication as ZeRO's mixed precision does (bf16 parameters and gradients, fp32 master
and AdamW moments: 2 + 14 / N bytes a parameter under zero2), ``dpar inspect`` the
model's own fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn

CONFIGS = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                 num_key_value_heads=8),
}


class CausalLM(nn.Module):
    """The model's mean next-token loss: what a training step differentiates."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, labels=ids, use_cache=False).loss


def llama3(size: str, rows: int = 1, seq: int = 2048, **overrides: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Llama 3 at ``size`` ("8b", "70b", "405b") on the meta device, and a (rows, seq) batch of token ids."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, **{**CONFIGS[size], **overrides}
    )
    with torch.device("meta"):
        model = CausalLM(transformers.LlamaForCausalLM(config))
    return model, (torch.zeros(rows, seq, dtype=torch.long, device="meta"),)


def llama3_8b() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return llama3("8b")


def llama3_70b() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return llama3("70b")


def llama3_405b() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return llama3("405b")


def llama3_8b_pipeline() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """For ``--pipeline --loss ...:model_loss``: the pipeline takes (model inputs..., target)."""
    model, (ids,) = llama3("8b")
    return model, (ids, ids)


def _bf16_pipeline(size: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """For ``dpar plan --pipeline --per-rank``: in bf16 (as Llama 3 trains), one row of 4096 tokens a rank."""
    model, (ids,) = llama3(size, seq=4096)
    return model.to(torch.bfloat16), (ids, ids)


def llama3_8b_bf16_pipeline() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return _bf16_pipeline("8b")


def llama3_70b_bf16_pipeline() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return _bf16_pipeline("70b")


def llama3_405b_bf16_pipeline() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return _bf16_pipeline("405b")


def model_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``--loss`` for ``dpar plan --pipeline``: the model already returns its loss (``target`` unused)."""
    return output
