"""The planner on a 24-block GPT at 64 ranks: repeated blocks collapse, and it plans in seconds."""

from __future__ import annotations

import time

import pytest
from planner_models import gpt

from dpar.planner.capture import build_op_graph
from dpar.planning import plan

GPT_24 = dict(n_layer=24, n_embd=1024, n_head=16, block=1024, vocab=50304, batch=64)


def test_ilp_size_does_not_grow_with_depth():
    sizes = [len(build_op_graph(*gpt(n_layer=n)).ops) for n in (4, 8, 24)]
    assert sizes[0] == sizes[1] == sizes[2]
    graph = build_op_graph(*gpt(n_layer=24))
    assert graph.traced_ops > 10 * len(graph.ops) / 3
    assert {op.count for op in graph.ops if op.module.startswith("blocks.")} == {12}


@pytest.mark.parametrize("mesh_shape", [(8, 8), (64,)])
def test_24_block_gpt_plans_at_64_ranks_in_under_10_s(mesh_shape):
    model, inputs = gpt(**GPT_24)  # meta device: no weights allocated
    start = time.perf_counter()
    p = plan(model, inputs, mesh_shape=mesh_shape)
    seconds = time.perf_counter() - start
    print(f"24-block GPT, mesh {mesh_shape}: planned in {seconds:.2f} s (capture included): {p.strategy}, "
          f"{p.cost.step_s * 1e3:.2f} ms/step")
    assert seconds < 10.0
    assert len(p.parameters) == len(list(model.parameters()))
