"""dpar.explain beyond ddp/zero2/fsdp: tensor parallel, sequence parallel, hsdp, the 2-D strategies
and auto, at world sizes no machine here has, against the numbers worked out by hand.

The model is one Megatron pair, Linear(16, 32) -> GELU -> Linear(32, 8): tensor parallel
splits ``up`` by rows (weight and bias) and ``down`` by columns, and keeps ``down.bias``
whole, so a rank of a tp group of t holds 4 * (32/t * 16 + 32/t + 8 * 32/t + 8) bytes.
A collective over a sub-group (a mesh dimension) is costed by that group's ring, not the world's.
"""

from __future__ import annotations

import io
import math
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rich.console import Console

from dpar.explaining import explain
from dpar.inspect.render_html import render_html
from dpar.inspect.render_text import print_report


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def tp_block_bytes(t: int) -> int:
    return 4 * (32 // t * 16 + 32 // t + 8 * 32 // t + 8)


def report(strategy: str, world_size: int, rows: int = 2, seq: int | None = None):
    torch.manual_seed(0)
    x = torch.randn(rows, 16) if seq is None else torch.randn(rows, seq, 16)
    return explain(Pair(), (x,), world_size=world_size, strategy=strategy)


def kinds(r, graph: str) -> Counter[str]:
    return Counter(c.kind for c in r.collectives if c.graph == graph)


def ring_all_reduce(nbytes: int, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks * nbytes


@pytest.mark.parametrize("n", [2, 8])
def test_tp_holds_megatron_blocks_and_each_ranks_rows_are_its_own_program(n: int) -> None:
    r = report("tp", n)
    assert r.memory.parameters == tp_block_bytes(n)
    forward = [c for c in r.collectives if c.graph == "forward graph"]
    reduces = [c for c in forward if c.kind == "all_reduce"]
    # The group's rows are gathered once; each rank's copy sums its row-parallel output once.
    assert kinds(r, "forward graph") == Counter(all_gather=1, all_reduce=n)
    assert {c.bytes for c in reduces} == {2 * 8 * 4}  # one rank's 2 rows of 8 outputs
    assert all(c.moved_bytes == pytest.approx(ring_all_reduce(c.bytes, n)) for c in reduces)


def test_ddp_plus_tp_costs_each_collective_by_its_own_mesh_dimension() -> None:
    """World 8 as (dp 4, tp 2): the activation all-reduce rings over 2 ranks, the gradient all-reduce over 4."""
    r = report("ddp+tp", 8)
    assert r.memory.parameters == tp_block_bytes(2)
    activation = [c for c in r.collectives if c.graph == "forward graph" and c.kind == "all_reduce"]
    gradient = [c for c in r.collectives if c.graph.startswith("backward") and c.bytes == tp_block_bytes(2)]
    assert len(activation) == 2 and all(c.moved_bytes == pytest.approx(ring_all_reduce(c.bytes, 2)) for c in activation)
    assert [c.kind for c in gradient] == ["all_reduce"]
    assert gradient[0].moved_bytes == pytest.approx(ring_all_reduce(tp_block_bytes(2), 4))
    assert {c.group for c in activation}.isdisjoint({c.group for c in gradient})
    # Tensor parallel's gathers carry rows and activations: neither parameter buckets nor gathered parameters.
    assert [b.collective for b in r.buckets] == ["all_reduce"] and r.memory.gathered == 0
    assert not r.scales_in_n and "Step time in N" not in [t.title for t in r.tables()]
    text = io.StringIO()
    print_report(r, Console(file=text, width=200), show_code=False)
    for rendered in (text.getvalue(), render_html(r)):
        assert "the figures hold for N = 8 only" in rendered and "step time(N)" not in rendered


def test_hsdp_shards_over_its_shard_dimension_and_all_reduces_over_replicas() -> None:
    """World 8 as (replicate 4, shard 2): each rank holds ceil(d0 / 2) rows of every parameter."""
    r = report("hsdp", 8)
    shapes = [(32, 16), (32, 1), (8, 32), (8, 1)]
    assert r.memory.parameters == sum(4 * math.ceil(d0 / 2) * row for d0, row in shapes)
    assert kinds(r, "backward graph") == Counter(reduce_scatter=1, all_reduce=1)
    (replicas,) = [c for c in r.collectives if c.kind == "all_reduce"]
    assert replicas.bytes == r.memory.parameters
    assert replicas.moved_bytes == pytest.approx(ring_all_reduce(replicas.bytes, 4))


def test_fsdp_plus_tp_shards_the_tp_block_over_data_parallel_ranks() -> None:
    r = report("fsdp+tp", 8)
    assert r.memory.parameters == tp_block_bytes(2) // 4
    assert kinds(r, "backward graph")["reduce_scatter"] == 1


def test_sequence_parallel_reduce_scatters_along_the_sequence_instead_of_all_reducing() -> None:
    r = report("tp+sp", 4, rows=2, seq=8)
    forward = kinds(r, "forward graph")
    assert forward["reduce_scatter"] == 4 and forward["all_reduce"] == 0  # one per rank's copy


def test_auto_plans_inside_the_simulated_world_and_the_timeline_runs_every_collective() -> None:
    r = report("auto", 4, rows=4)
    assert r.strategy == "auto" and r.collectives
    issued = [e for e in r.timeline.events if e.stream == "comm" and e.rank == 0]
    assert len(issued) == len(r.collectives)


def test_every_pass_is_recorded_the_joint_graphs_included() -> None:
    """The joint graph's passes (run before the partitioner) go through the same runner as the
    forward's and backward's, so a report shows each of them and what it added."""
    r = report("fsdp+tp", 8)
    stages = {g.label: [s.pass_name for s in g.stages] for g in r.graphs}
    assert stages["joint graph"] == ["captured", "unroll_group_batch", "tensor_parallel", "tag_gathers", "save_random_ops",
                                     "keep_collectives_in_forward"]
    assert stages["forward graph"] == ["captured", "broadcast_buffers", "bucket_all_gathers", "sink_waits", "prefetch_all_gathers"]
    (joint,) = [g for g in r.graphs if g.label == "joint graph"]
    assert any(d.startswith("unroll_group_batch: all_gather") for d in joint.op_count_diffs())
    assert any(d.startswith("tensor_parallel: all_reduce") for d in joint.op_count_diffs())
    assert "joint graph" not in {c.graph for c in r.collectives}  # its collectives are the others', not extra


def test_a_lazy_module_builds_and_runs_after_tensor_parallel_was_inspected() -> None:
    # tensor parallel's parameter-registration hook is process-wide; a lazy module registers a parameter
    # with no memory (UninitializedParameter), which the hook must pass over
    r = report("tp", 2)
    torch.manual_seed(0)
    lazy = nn.Sequential(nn.Linear(3, 4), nn.LazyLinear(2))
    x = torch.randn(5, 3)
    assert lazy(x).shape == (5, 2) and lazy[1].weight.shape == (2, 4)
    assert r.memory.parameters == tp_block_bytes(2)
