"""Tensor parallel on attention as other projects write it: Hugging Face Llama (RoPE, GQA), BERT
(padding mask), T5 (relative position bias), GPT-2, and the nanoGPT-style example, against one
process on the same batch; and a tied vocabulary the degree does not divide.

Every rank of the tp group is fed the same rows (``same_batch_in_tp_group=True``), so one
process on that batch is the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distributed import run_ranks
from dpar.compiler.megatron import megatron_dims
from third_party import build, global_batch, max_abs_diff
from training import TOLERANCE

STEPS, ROWS = 5, 4


def nano_gpt(vocab_size: int = 64) -> nn.Module:
    """examples/gpt.py with separate q/k/v and a tied LM head."""
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=16, n_layer=2, n_head=4, n_embd=32, fused_qkv=False))


def model_of(name: str) -> nn.Module:
    if name == "nanogpt":
        return nano_gpt()
    if name.startswith("nanogpt-vocab"):
        return nano_gpt(int(name.removeprefix("nanogpt-vocab")))
    return build(name)


def batch_of(name: str, step: int) -> tuple[torch.Tensor, ...]:
    ids, labels, mask = global_batch(step, ROWS)
    return (ids, ids.roll(-1, 1)) if name.startswith("nanogpt") else (ids, labels, mask)


def optimizer_of(name: str, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05) if name == "sgd" else torch.optim.AdamW(params, lr=1e-3)


def train(model: nn.Module, runner: nn.Module, name: str, optimizer: str) -> list[float]:
    opt = optimizer_of(optimizer, [p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = runner(*batch_of(name, step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_tensor_parallel(
    rank: int, world_size: int, name: str, optimizer: str, tp_plan: dict[str, int | None] | None = None
) -> tuple[list[float], dict]:
    import dpar

    model = model_of(name)
    dpar.parallelize(model, strategy="tp", example_inputs=batch_of(name, 0), same_batch_in_tp_group=True, tp_plan=tp_plan)
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    losses = train(model, runner, name, optimizer)
    return losses, dpar.checkpoint.full_state_dict(model)


def train_one_process(name: str, optimizer: str) -> tuple[list[float], dict]:
    model = model_of(name)
    losses = train(model, model, name, optimizer)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- the plan ---------------------------------------------------------------------------------

TEXTBOOK = {  # model -> (column-parallel Linears, row-parallel Linears) of the first block
    "llama": (
        [f"inner.model.layers.0.self_attn.{p}_proj" for p in "qkv"] + [f"inner.model.layers.0.mlp.{p}_proj" for p in ("gate", "up")],
        ["inner.model.layers.0.self_attn.o_proj", "inner.model.layers.0.mlp.down_proj"],
    ),
    "bert": (
        [f"inner.bert.encoder.layer.0.attention.self.{p}" for p in ("query", "key", "value")]
        + ["inner.bert.encoder.layer.0.intermediate.dense"],
        ["inner.bert.encoder.layer.0.attention.output.dense", "inner.bert.encoder.layer.0.output.dense"],
    ),
    "t5": (
        [f"inner.{stack}.block.0.layer.0.SelfAttention.{p}" for stack in ("encoder", "decoder") for p in "qkv"]
        + [f"inner.decoder.block.0.layer.1.EncDecAttention.{p}" for p in "qkv"]
        + ["inner.encoder.block.0.layer.1.DenseReluDense.wi", "inner.decoder.block.0.layer.2.DenseReluDense.wi"],
        [f"inner.{stack}.block.0.layer.0.SelfAttention.o" for stack in ("encoder", "decoder")]
        + ["inner.decoder.block.0.layer.1.EncDecAttention.o"]
        + ["inner.encoder.block.0.layer.1.DenseReluDense.wo", "inner.decoder.block.0.layer.2.DenseReluDense.wo"],
    ),
    "nanogpt": (
        [f"blocks.0.attn.{p}" for p in "qkv"] + ["blocks.0.mlp.up"],
        ["blocks.0.attn.proj", "blocks.0.mlp.down"],
    ),
}


@pytest.mark.parametrize("name", list(TEXTBOOK))
def test_the_automatic_plan_is_megatrons_column_then_row(name: str) -> None:
    """Followed through masks, RoPE's cos/sin and rotate_half, GQA's repeat and relative bias,
    the split heads reach the output projection, which is therefore row parallel."""
    dims = megatron_dims(model_of(name), batch_of(name, 0))
    column, row = TEXTBOOK[name]
    assert {f"{m}.weight": dims[f"{m}.weight"] for m in column} == {f"{m}.weight": 0 for m in column}
    assert {f"{m}.weight": dims[f"{m}.weight"] for m in row} == {f"{m}.weight": 1 for m in row}


def test_the_automatic_plan_splits_gpt2s_conv1d_by_its_output_columns() -> None:
    """GPT-2 stores (in, out) weights and calls addmm: column parallel splits dim 1, row dim 0.
    Its fused c_attn is cut into q/k/v along the split dim, so the attention output projection
    reads a gathered value and stays column parallel (correct, not head-split)."""
    dims = megatron_dims(model_of("gpt2"), batch_of("gpt2", 0))
    block = "inner.transformer.h.0"
    assert dims[f"{block}.attn.c_attn.weight"] == 1 and dims[f"{block}.attn.c_attn.bias"] == 0
    assert dims[f"{block}.mlp.c_fc.weight"] == 1 and dims[f"{block}.mlp.c_proj.weight"] == 0
    assert dims[f"{block}.mlp.c_proj.bias"] is None


# --- numerics on 2 gloo ranks ----------------------------------------------------------------

# Hugging Face T5 and GPT-2 under tp on per-rank slices (BERT's by `-m extended`): tests/test_third_party_models.py.
CASES = [
    ("llama", "adamw"),
    ("nanogpt", "adamw"),
    ("nanogpt-vocab97", "adamw"),  # a tied vocabulary 2 ranks do not divide: blocks of 49 and 48 rows
]


@pytest.mark.parametrize("name,optimizer", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_tensor_parallel_matches_one_process(name: str, optimizer: str) -> None:
    (losses, parallel), _ = run_ranks(train_tensor_parallel, 2, name, optimizer, timeout_s=600)
    reference_losses, reference = train_one_process(name, optimizer)
    diff = max_abs_diff(parallel, reference)
    print(f"tp on 2 ranks, {name} {optimizer}: losses {losses} vs {reference_losses}, max |difference| {diff:.2e}")
    assert abs(losses[0] - reference_losses[0]) <= 1e-5  # the forward at step 0, before any update
    assert diff <= TOLERANCE[optimizer]


def test_partial_sums_carried_into_a_replicated_attention_keep_their_layout() -> None:
    """The planner's plan for a 3-layer Llama on (dp 4, tp 2): the vocabulary and the MLPs split, attention
    replicated. Propagation carries the embedding's partial sums through the norm into q, k and v after RoPE and
    reduces them before attention; those values are transposed ([B, H, S, D] over [B, S, H, D] memory) and
    attention's output is viewed back by its strides, so a reduction that came back contiguous could not be
    compiled ("Cannot view a tensor ... as (4, 8, 32)"). Reduced in memory order, it keeps the strides."""
    model = model_of("llama")
    plan = {name: None for name, _ in model.named_parameters()}
    plan |= {"inner.model.embed_tokens.weight": 0, "inner.lm_head.weight": 0}
    for name in plan:
        if ".mlp." in name:
            plan[name] = 1 if "down_proj" in name else 0
    (losses, parallel), _ = run_ranks(train_tensor_parallel, 2, "llama", "adamw", plan, timeout_s=600)
    reference_losses, reference = train_one_process("llama", "adamw")
    diff = max_abs_diff(parallel, reference)
    print(f"tp on 2 ranks, Llama with attention replicated: losses {losses} vs {reference_losses}, max |difference| {diff:.2e}")
    assert abs(losses[0] - reference_losses[0]) <= 1e-5
    assert diff <= TOLERANCE["adamw"]


def test_a_degree_that_leaves_a_rank_no_block_is_refused(world_of_four) -> None:
    """Uneven blocks are fine (30 rows over 4 ranks: 8, 8, 8, 6); 3 rows over 4 ranks would leave one empty."""
    import dpar
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match=r"tensor parallel degree 4 leaves some ranks no part of dimension 0 of 0.weight \(shape \(3, 16\)\); choose a degree of at most 3"):
        dpar.parallelize(
            nn.Sequential(nn.Linear(16, 3)), strategy="tp", mesh=init_device_mesh("cpu", (4,)), tp_plan={"0.weight": 0}
        )
