"""dpar.explain on a small MLP: tables checked against numbers worked out by hand.

The MLP is Linear(16, 32) -> ReLU -> Linear(32, 4) in fp32, batch 4:
  0.weight 512 floats, 0.bias 32, 2.weight 128, 2.bias 4: 676 floats = 2704 bytes.
The backward produces the gradients in the order 2.bias, 2.weight, 0.bias, 0.weight.
With a 500-byte cap a bucket closes once it reaches the cap:
  bucket 0 = 2.bias + 2.weight = 16 + 512 = 528 bytes,
  bucket 1 = 0.bias + 0.weight = 128 + 2048 = 2176 bytes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import dpar  # noqa: F401  (registers the backend)
from dpar.compiler.costs import PRESETS
from dpar.explaining import explain
from dpar.compiler.registry import recording
from dpar.core.errors import OptionsError, ProcessGroupError
from torch.testing._internal.distributed.fake_pg import FakeStore

CAP_BYTES = 500
H100 = PRESETS["h100"]


def mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), (torch.randn(4, 16),)


def ring_all_reduce_seconds(nbytes: int, n: int) -> float:
    """On NVLink while the world fits in one node of 8, on the NICs past it."""
    alpha, beta = H100.intra_link if n <= H100.node_size else H100.inter_link
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


@pytest.fixture(scope="module", params=[2, 8, 64])
def report(request):
    model, inputs = mlp()
    return explain(model, inputs, world_size=request.param, options={"bucket_cap_mb": CAP_BYTES / 2**20})


def test_collective_table_has_one_all_reduce_per_bucket_with_hand_computed_bytes(report):
    n = report.world_size
    rows = report.collectives
    assert [(c.kind, c.graph, c.dtype, c.bytes, c.bucket) for c in rows] == [
        ("all_reduce", "backward graph (sync)", "float32", 528, 0),
        ("all_reduce", "backward graph (sync)", "float32", 2176, 1),
    ]
    assert [c.moved_bytes for c in rows] == pytest.approx([2 * (n - 1) / n * 528, 2 * (n - 1) / n * 2176])
    assert [c.seconds for c in rows] == pytest.approx([ring_all_reduce_seconds(528, n), ring_all_reduce_seconds(2176, n)])
    assert all(c.issue_node.startswith("all_reduce") and c.wait_node.startswith("wait_tensor") for c in rows)
    # Sunk waits: the second bucket's gradient math runs while the first all-reduce is in flight.
    assert rows[0].compute_between > 0
    assert rows[1].compute_between == 0


def test_bucket_table_names_parameters_in_readiness_order_with_fill(report):
    assert [(b.parameters, b.bytes, b.cap_bytes) for b in report.buckets] == [
        (("2.bias", "2.weight"), 528, CAP_BYTES),
        (("0.bias", "0.weight"), 2176, CAP_BYTES),
    ]
    assert [b.fill for b in report.buckets] == pytest.approx([528 / 500, 2176 / 500])
    table = report.bucket_table()
    assert table.rows[0][3] == "2.bias, 2.weight"
    assert table.rows[1][5].startswith("435.2% of")


def test_per_rank_memory_is_replicated_under_ddp(report):
    m = report.memory
    assert (m.parameters, m.gradients, m.optimizer) == (2704, 2704, 2 * 2704)  # AdamW: exp_avg, exp_avg_sq
    # Backward peak, by hand: saved relu 512 + tangent 64, then the 0.weight/0.bias gradients
    # (2048 + 128) and their flattened bucket (2176) at the second cat: 4352 bytes.
    assert m.activations == 4352
    assert m.total == 2704 * 4 + 4352
    assert m.total_at(1024) == m.total


def test_memory_timeline_worked_out_by_hand():
    """ddp on 2 ranks, one bucket. Forward: the first Linear's output (4 x 32 fp32, 512 B) and ReLU's (512 B)
    both alive at its highest, 1024 B; it ends holding ReLU's output for the backward and the model's output
    (4 x 4, 64 B): 576 B. Backward: at its highest the 2704 B of gradients (676 floats) beside the bucket they
    are copied into (2704 B); it ends holding the gradients, which live to the optimizer."""
    model, inputs = mlp()
    report = explain(model, inputs, world_size=2)
    forward = [b for graph, _, b in report.memory_timeline if graph == "forward graph"]
    backward = [b for graph, _, b in report.memory_timeline if graph.startswith("backward")]
    assert len(forward) + len(backward) == len(report.memory_timeline)
    assert (max(forward), forward[-1]) == (1024, 576)
    assert (backward[0], max(backward), backward[-1]) == (0, 2 * 2704, 2704)
    assert report.memory.step_peak == 2 * 2704
    table = report.memory_timeline_table()
    assert [row[0] for row in table.rows] == ["forward graph", "backward graph (sync)"]


def test_graphs_per_pass_and_op_count_diffs(report):
    labels = [g.label for g in report.graphs]
    assert labels == ["forward graph", "backward graph (sync)"]
    backward = report.graphs[1]
    assert [s.pass_name for s in backward.stages] == ["captured", "all_reduce_gradients", "sink_waits"]
    assert "_c10d_functional.all_reduce" not in backward.stages[0].code
    assert backward.code.count("_c10d_functional.all_reduce.default(") == 2
    assert backward.op_count_diffs() == [
        "all_reduce_gradients: all_reduce: 0 -> 2",
        "all_reduce_gradients: wait_tensor: 0 -> 2",
    ]
    assert report.graphs[0].op_count_diffs() == []


def test_explain_leaves_no_process_group_registry_entries_or_gradients():
    model, inputs = mlp()
    with recording() as graphs:
        report = explain(model, inputs, world_size=4)
    assert not dist.is_initialized()
    assert graphs == [] and report.graphs  # explain's graphs are its report's, not the caller's
    assert all(p.grad is None for p in model.parameters())


def test_explain_refuses_beside_an_initialized_process_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ProcessGroupError, match="already initialized"):
            explain(*mlp(), world_size=4)
    finally:
        dist.destroy_process_group()


def test_unknown_strategy_names_the_available_ones():
    with pytest.raises(OptionsError, match="'ddp'"):
        explain(*mlp(), world_size=4, strategy="zero7")


def test_world_size_one_shows_the_captured_graphs_without_collectives():
    report = explain(*mlp(), world_size=1)
    assert report.collectives == ()
    assert [g.label for g in report.graphs] == ["forward graph", "backward graph (sync)"]
    assert report.memory.activations == 1536  # 1024 in forward (addmm + relu), 1536 in backward
    assert report.timeline.comm_time == 0
