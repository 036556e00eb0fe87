"""dpar.explain / dpar plan on a Llama built on the meta device: nothing allocated, the figures right.

A two-layer Llama-3-8B (real hidden sizes, vocabulary 128256) on meta at N = 64.
Its parameters: embedding and head 2 * 128256 * 4096, per layer q, o 4096^2,
k, v 1024 * 4096, gate, up, down 3 * 14336 * 4096, two norms 2 * 4096, final
norm 4096: P = 1,486,901,248 elements, 4P = 5,947,604,992 bytes in fp32.
ddp all-reduces every gradient once: its buckets sum to 4P. fsdp holds rank 0's
ceil(d0 / 64) rows of each parameter (ZeRO-3: 4P/N within padding).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from dpar.explaining import explain
from dpar.core.errors import InspectionError

transformers = pytest.importorskip("transformers")

LAYERS = 2
HIDDEN, FFN, KV, VOCAB = 4096, 14336, 1024, 128256
P = 2 * VOCAB * HIDDEN + LAYERS * (2 * HIDDEN**2 + 2 * KV * HIDDEN + 3 * FFN * HIDDEN + 2 * HIDDEN) + HIDDEN
N = 64


def meta_llama(seq: int = 256) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """examples/llama3_on_paper.py's Llama-3-8B at full width, LAYERS layers deep."""
    from llama3_on_paper import llama3

    return llama3("8b", seq=seq, num_hidden_layers=LAYERS)


def test_parameter_count_is_the_hand_count():
    model, _ = meta_llama()
    assert sum(p.numel() for p in model.parameters()) == P


def test_ddp_all_reduces_every_gradient_byte_on_meta():
    report = explain(*meta_llama(), world_size=N, strategy="ddp", device="h100")
    reduced = [c for c in report.collectives if c.graph.startswith("backward") and c.kind == "all_reduce"]
    assert sum(c.bytes for c in reduced) == 4 * P
    assert sum(b.bytes for b in report.buckets if b.collective == "all_reduce") == 4 * P
    # ring all-reduce: 2 (N - 1) / N of the payload leaves each rank
    assert sum(c.moved_bytes for c in reduced) == pytest.approx(2 * (N - 1) / N * 4 * P, rel=1e-9)
    assert report.memory.parameters == 4 * P and report.memory.optimizer == 8 * P
    assert report.timeline.comm_time > 0.01  # ~6 GB over the ring, not a broadcast of a buffer


def test_fsdp_holds_a_64th_and_moves_three_times_the_parameters_on_meta():
    model, inputs = meta_llama()
    report = explain(model, inputs, world_size=N, strategy="fsdp", device="h100")
    padded = sum(math.ceil(p.shape[0] / N) * math.prod(p.shape[1:]) for p in model.parameters())
    assert report.memory.parameters == 4 * padded
    assert 4 * P / N <= report.memory.parameters <= 4 * P / N * 1.01
    assert report.memory.gradients == report.memory.parameters
    assert report.memory.optimizer == 2 * report.memory.parameters
    backward = [c for c in report.collectives if c.graph.startswith("backward")]
    scattered = sum(c.bytes for c in backward if c.kind == "reduce_scatter")
    gathered = sum(c.bytes for c in report.collectives if c.kind == "all_gather")
    assert scattered == 4 * padded * N  # every gradient once, padded to N shards
    # forward gathers everything; the backward gathers again what the forward freed (the layers)
    assert 4 * padded * N < gathered <= 2 * 4 * padded * N


def test_a_data_parallel_backward_without_gradient_reduction_is_refused():
    model, inputs = meta_llama(seq=16)
    frozen_loss = lambda ids: model(ids).detach().requires_grad_()  # noqa: E731  (a loss no parameter reaches)

    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return frozen_loss(ids)

    with pytest.raises(InspectionError, match="reduce no gradient"):
        explain(Detached(), inputs, world_size=N, strategy="ddp")


def test_plan_on_a_meta_model_returns_a_plan():
    from dpar.planning import global_batch, plan

    model, inputs = meta_llama()
    chosen = plan(model, global_batch(inputs, N), mesh_shape=(N,))
    assert {p.name for p in chosen.parameters} == {n for n, _ in model.named_parameters()}


def test_a_hugging_face_model_keeping_its_default_cache_setting_is_explained_on_meta():
    """LlamaForCausalLM with its config's use_cache=True, built on meta and called as model(ids): explain calls it
    as training does (use_cache=False, as the planner's capture does), where the cache's own empty tensors, made on
    meta inside the traced call, stopped the fake-tensor trace."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    assert config.use_cache
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    report = explain(model, (torch.zeros(4, 16, dtype=torch.long, device="meta"),), strategy="fsdp", world_size=2)
    assert report.memory.parameters == sum(p.numel() for p in model.parameters()) * 4 // 2
