"""Bad input to dpar.plan fails early with the fix in the message."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from planner_models import FAST, SLOW, gpt, hardware, mlp
from torch.testing._internal.distributed.fake_pg import FakeStore

import dpar
from dpar.planner.capture import build_op_graph
from dpar.planner.rules import candidates
from dpar.planner.strategies import strategy_assignment
from dpar.planning import plan


@pytest.fixture
def world_of_8():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_mesh_shape_must_cover_the_world(world_of_8):
    model, inputs = mlp(256, 64)
    with pytest.raises(dpar.OptionsError, match=r"mesh_shape \(2, 2\) covers 4 ranks but the world has 8; use a mesh_shape whose product is 8"):
        plan(model, inputs, mesh_shape=(2, 2), device=hardware(SLOW, FAST))
    assert plan(model, inputs, mesh_shape=(2, 4), device=hardware(SLOW, FAST)).mesh_shape == (2, 4)


def test_forced_tp_degree_that_divides_nothing_is_an_error():
    model, inputs = mlp(256, 63)
    with pytest.raises(dpar.OptionsError, match=r"tensor parallel over 3 ranks, but 3 divides no shardable dimension"):
        plan(model, inputs, mesh_shape=(3,), mesh_dim_names=("tp",), device=hardware(FAST))


def test_hand_written_tp_whose_degree_does_not_divide_a_linear_is_an_error():
    model, inputs = mlp(100, 64)
    graph = build_op_graph(model, inputs)
    with pytest.raises(dpar.OptionsError, match=r"tp degree 8 does not divide the out_features of layers.0 \(weight \(100, 100\)\)"):
        strategy_assignment(graph, "tp", (8,))


def test_candidates_a_tp_degree_does_not_divide_are_left_out():
    model, inputs = gpt(n_layer=2, n_embd=256, n_head=8)  # 8 heads do not split 16 ways; 256 features do
    graph = build_op_graph(model, inputs)
    attention = next(op for op in graph.ops if op.kind == "attention")
    q = next(op for op in graph.ops if op.module.endswith("attn.q"))
    assert [c.name for c in candidates(attention, 16)] == ["replicate"]
    assert [c.name for c in candidates(attention, 8)] == ["replicate", "shard"]
    assert [c.name for c in candidates(q, 16)] == ["replicate", "column", "row"]
    p = plan(model, inputs, mesh_shape=(16,), mesh_dim_names=("tp",), device=hardware(FAST))
    assert {o.choice for o in p.ops if o.kind == "attention"} == {"replicate"}


def test_batch_that_dp_cannot_split_is_an_error_when_dp_is_forced_and_avoided_otherwise():
    model, inputs = mlp(4096, 6)
    with pytest.raises(dpar.OptionsError, match=r"batch of 6 does not split over a data-parallel degree of 8 .* multiple of 8"):
        plan(model, inputs, mesh_shape=(8,), mesh_dim_names=("dp",), device=hardware(FAST))
    assert plan(model, inputs, mesh_shape=(8,), device=hardware(FAST)).strategy == "tp"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mesh_shape=(2, 4), mesh_dim_names=("dp", "pp")), r"name each of the 2 mesh dimension\(s\) 'dp', 'tp', 'ep' or 'cp'"),
        (dict(mesh_shape=(2, 4), mesh_dim_names=("tp", "tp")), r"at most one dimension can be 'tp'"),
        (dict(mesh_shape=(2, 4), mesh_dim_names=("dp", "cp")),
         r"asks for context parallel over 4 ranks, but the model has no attention over a sequence dim of its inputs"),
        (dict(mesh_shape=(0, 4)), r"mesh_shape must be positive ints"),
        (dict(mesh_shape=(2, 4), device=hardware(FAST)), r"device 'test' has links for 1 mesh dimension\(s\) but mesh_shape \(2, 4\) has 2"),
    ],
)
def test_bad_mesh_arguments_name_the_fix(kwargs, message):
    model, inputs = mlp(256, 64)
    kwargs.setdefault("device", hardware(SLOW, FAST))
    with pytest.raises(dpar.OptionsError, match=message):
        plan(model, inputs, **kwargs)
