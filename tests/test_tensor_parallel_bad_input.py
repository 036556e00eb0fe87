"""Tensor parallel refuses what it cannot do, naming the fix."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dpar
from gpt import GPT, GPTConfig
from models import MLP


def test_two_dimensional_strategies_need_a_named_two_dimensional_mesh(world_of_four) -> None:
    with pytest.raises(ValueError, match=r"'fsdp\+tp' needs a 2-D mesh \(dp, tp\) over the whole world \(4 ranks\), got \(4,\).*mesh_dim_names=\('dp', 'tp'\)"):
        dpar.parallelize(MLP(), strategy="fsdp+tp", mesh=init_device_mesh("cpu", (4,)), example_inputs=(torch.randn(2, 16),))
    with pytest.raises(ValueError, match=r"needs the 2-D mesh's dimensions named \('dp', 'tp'\)"):
        dpar.parallelize(MLP(), strategy="ddp+tp", mesh=init_device_mesh("cpu", (2, 2)), example_inputs=(torch.randn(2, 16),))


def test_tp_over_part_of_the_world(world_of_four) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"'tp' needs a 1-D mesh over the whole world \(4 ranks\), got mesh shape \(2, 2\); for a 2-D mesh use 'ddp\+tp' or 'fsdp\+tp'"):
        dpar.parallelize(MLP(), strategy="tp", mesh=mesh, example_inputs=(torch.randn(2, 16),))


def test_tp_needs_example_inputs_or_a_plan(world_of_four) -> None:
    with pytest.raises(ValueError, match=r"pass example_inputs=\(\.\.\.\).*or tp_plan="):
        dpar.parallelize(MLP(), strategy="tp")


def test_a_plan_naming_no_parameter_and_tied_weights_split_two_ways(world_of_four) -> None:
    with pytest.raises(ValueError, match=r"names 'net.9.weight', which is not a parameter of the model"):
        dpar.parallelize(MLP(), strategy="tp", tp_plan={"net.9.weight": 0})
    gpt = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, fused_qkv=False))
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to tok_emb.weight but the plan splits them differently"):
        dpar.parallelize(gpt, strategy="tp", tp_plan={"tok_emb.weight": 0, "lm_head.weight": 1})


def test_sequence_parallel_needs_a_tensor_parallel_strategy(world_of_four) -> None:
    with pytest.raises(ValueError, match=r"sequence_parallel .* needs a tensor-parallel strategy without a cp axis.*\(tp, ddp\+tp, zero2\+tp, fsdp\+tp\), not 'fsdp'"):
        dpar.parallelize(MLP(), strategy="fsdp", sequence_parallel=True)
