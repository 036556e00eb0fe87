"""dpar.explain / dpar inspect under zero2 and fsdp, checked against ZeRO's formulas worked out by hand.

Per-rank memory at rest. The stack below is two Linear(24, 24) blocks and a
Linear(24, 10) head in fp32: Ψ = 2 * (576 + 24) + 240 + 10 = 1450 parameters.
ZeRO-3 with fp32 Adam holds 4Ψ/N (parameters) + 4Ψ/N (gradients) + 8Ψ/N (Adam's
two moments) per rank. DTensor's Shard(0) follows torch.chunk, so rank 0 holds
ceil(d0 / N) rows of a d0-row parameter, the most of any rank: its padding over
Ψ/N is Σ (ceil(d0 / N) - d0 / N) * (row size) elements. By hand:
  N = 8:    rows 3 (d0 = 24) and 2 (d0 = 10): 2 * (72 + 3) + 48 + 2 = 200 elements;
            padding (2 - 10/8) * 24 + (2 - 10/8) = 18.75 elements.
  N = 64:   one row of everything: 3 * (24 + 1) = 75 elements.
  N = 1024: the same 75: ranks past d0 hold nothing, rank 0 still one row.
"""

from __future__ import annotations

import functools
import math
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from machine_speed import budget_s

import dpar
from dpar.cli import main
from dpar.compiler.costs import PRESETS
from dpar.explaining import explain
from dpar.surgery.sharding import block_of
from fake_world import fake_world

ROOT_DIR = Path(__file__).resolve().parent.parent
H100 = PRESETS["h100"]
PSI = 1450
RANK0_ELEMENTS = {8: 200, 64: 75, 1024: 75}


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(24, 24) for _ in range(2))
        self.head = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def stack() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return Stack(), (torch.randn(4, 24),)


def padding_elements(n: int) -> Fraction:
    """Rank 0's elements beyond Ψ/N: (ceil(d0/N) - d0/N) * row size, summed over the parameters."""
    shapes = [(24, 24), (24, 1)] * 2 + [(10, 24), (10, 1)]
    return sum(Fraction(-(-d0 // n)) * row - Fraction(d0 * row, n) for d0, row in shapes)


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
@pytest.mark.parametrize("n", [8, 64, 1024])
def test_per_rank_state_is_zero3_formula_plus_exact_padding(strategy, n):
    m = explain(*stack(), world_size=n, strategy=strategy).memory
    shard = Fraction(4 * PSI, n) + 4 * padding_elements(n)  # bytes of one fp32 copy of rank 0's shards
    assert shard == 4 * RANK0_ELEMENTS[n]
    assert (m.parameters, m.gradients, m.optimizer) == (shard, shard, 2 * shard)  # 4Ψ/N, 4Ψ/N, 8Ψ/N
    assert m.parameters + m.gradients + m.optimizer == Fraction(16 * PSI, n) + 16 * padding_elements(n)
    assert m.total_at(n) == m.total
    if n < 1024:
        assert m.gathered > 0  # gathered parameters are counted during the step, not at rest
    else:  # each of a weight's 24 rows padded to one a rank: the unscattered gradient buckets, held by their
        # reduce-scatters to the wait ([Note: a collective holds its input]), outweigh the gathers at the peak
        assert m.activations > 100 * shard


@pytest.mark.parametrize("n", [8, 1024])
def test_held_bytes_equal_rank_0s_local_shards(n):
    with fake_world(n):
        model, _ = stack()
        dpar.parallelize(model, strategy="fsdp")
        local = sum(p.to_local().numel() for p in model.parameters())
    assert local == RANK0_ELEMENTS[n]


def test_ddp_keeps_the_replicated_formula_and_gathers_nothing():
    m = explain(*stack(), world_size=8, strategy="ddp").memory
    assert (m.parameters, m.gradients, m.optimizer, m.gathered) == (4 * PSI, 4 * PSI, 8 * PSI, 0)


# ---- the 4-block GPT example under fsdp and zero2 at N = 8 ----------------------------------

N = 8
BLOCK_ELEMENTS = 2 * 128 + (128 * 384 + 384) + (128 * 128 + 128) + 2 * 128 + (128 * 512 + 512) + (512 * 128 + 128)
ROOT_ELEMENTS = 256 * 128 + 64 * 128 + 2 * 128  # tok_emb (= lm_head), pos_emb, ln_f


def gpt():
    from gpt import default

    return default()


@functools.cache
def gpt_report(strategy: str):
    return explain(*gpt(), world_size=N, strategy=strategy)


@pytest.fixture(params=["fsdp", "zero2"])
def report(request):
    return gpt_report(request.param)


def bucket_owner(parameters: tuple[str, ...]) -> str:
    """The block every parameter of a bucket belongs to (``root``: outside the numbered blocks)."""
    (owner,) = {block_of(p) for p in parameters}
    return owner


def rows(report, graph: str, kind: str):
    return [c for c in report.collectives if c.graph == graph and c.kind == kind]


def test_a_sequential_root_gathers_one_child_at_a_time():
    """``nn.Sequential``'s children are named ``0.weight``, ``1.weight``: each is a block (they once all fell
    into ``root``, so fsdp gathered the whole model at once, 4 blocks of memory where FSDP holds one)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(24, 24), nn.ReLU()) for _ in range(4)), nn.Linear(24, 10))
    report = explain(model, torch.randn(4, 24), world_size=N, strategy="fsdp")
    gathers = rows(report, "forward graph", "all_gather")
    assert [bucket_owner(report.buckets[c.bucket].parameters) for c in gathers] == ["0", "1", "2", "3", "4"]
    assert [c.bytes for c in gathers] == [4 * (576 + 24)] * 4 + [4 * -(-10 // N) * N * 25]  # the head's rows padded to N


def test_forward_gathers_one_bucket_per_block_plus_root_with_formula_bytes(report):
    gathers = rows(report, "forward graph", "all_gather")
    owners = [bucket_owner(report.buckets[c.bucket].parameters) for c in gathers]
    assert owners == ["root", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert [c.bytes for c in gathers] == [4 * ROOT_ELEMENTS] + [4 * BLOCK_ELEMENTS] * 4  # gathered size
    for c in report.collectives:  # ring: (N-1)/N of the full size, (N-1) latency steps
        assert c.moved_bytes == pytest.approx((N - 1) / N * c.bytes)
        alpha, beta = H100.intra_link  # N = 8: one node's NVLink
        assert c.seconds == pytest.approx((N - 1) * alpha + (N - 1) / N * c.bytes * beta)
    assert [b.fill for b in report.buckets] == [None] * len(report.buckets)


def test_each_gather_is_issued_before_the_previous_blocks_compute(report):
    (forward,) = [g for g in report.graphs if g.label == "forward graph"]
    nodes = list(forward.graph.graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    gathers = rows(report, "forward graph", "all_gather")
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    for previous, gather in zip(gathers, gathers[1:]):
        # One ahead (max_inflight_gathers=1): issued once the previous bucket is waited for,
        # before any of that bucket's matrix multiplies.
        start, issue = position[previous.wait_node], position[gather.issue_node]
        assert start < issue
        assert not any(n.target in matmuls for n in nodes[start:issue])
    assert all(c.compute_between > 0 for c in gathers[1:])


def test_backward_reduce_scatters_one_bucket_per_block_and_root(report):
    scatters = rows(report, "backward graph", "reduce_scatter")
    owners = [bucket_owner(report.buckets[c.bucket].parameters) for c in scatters]
    assert owners == ["blocks.3", "blocks.2", "blocks.1", "blocks.0", "root"]
    assert [c.bytes for c in scatters[:4]] == [4 * BLOCK_ELEMENTS] * 4
    regathers = rows(report, "backward graph", "all_gather")
    # fsdp reshards every block after forward; the root, used last, stays gathered into backward.
    assert len(regathers) == (4 if report.strategy == "fsdp" else 0)


def test_root_reduce_scatter_carries_each_gradient_once(report):
    root = rows(report, "backward graph", "reduce_scatter")[-1]
    assert bucket_owner(report.buckets[root.bucket].parameters) == "root"
    assert root.bytes == 4 * ROOT_ELEMENTS


def test_timeline_runs_every_gather_and_reduce_scatter(report):
    t = report.timeline
    comm = [e for e in t.events if e.rank == 0 and e.stream == "comm"]
    assert [e.name for e in comm] == [c.issue_node for c in report.collectives if c.graph == "forward graph"] + [
        c.issue_node for c in report.collectives if c.graph == "backward graph"
    ]
    assert t.comm_time == pytest.approx(sum(c.seconds for c in report.collectives))


def gpt_shapes() -> list[tuple[int, int]]:
    """(d0, elements per row) of every parameter, the tied embedding once."""
    model, _ = gpt()
    params = {id(p): p for p in model.parameters()}.values()
    return [(p.shape[0], math.prod(p.shape[1:])) for p in params]


def test_memory_rows_split_shards_gathered_parameters_and_activations(report):
    m = report.memory
    params = sum(math.ceil(d0 / N) * row for d0, row in gpt_shapes()) * 4
    assert (m.parameters, m.gradients, m.optimizer) == (params, params, 2 * params)
    assert params * N == 4 * (4 * BLOCK_ELEMENTS + ROOT_ELEMENTS)  # N = 8 divides every d0: no padding
    assert 0 < m.gathered < 4 * (4 * BLOCK_ELEMENTS + ROOT_ELEMENTS)
    table = dict((r[0], r[1]) for r in report.memory_table().rows)
    assert table["gathered parameters (at the peak)"] == f"{m.gathered:,}"


def test_zero2_keeps_more_gathered_parameters_than_fsdp():
    """fsdp frees each block after use and gathers it again; zero2 keeps what the backward reads."""
    fsdp, zero2 = gpt_report("fsdp").memory, gpt_report("zero2").memory
    assert fsdp.gathered < zero2.gathered
    assert gpt_report("fsdp").saved_activations == gpt_report("zero2").saved_activations


def test_cli_fsdp_at_1024_ranks_in_under_a_minute(capsys):
    target = str(ROOT_DIR / "examples" / "gpt.py")
    start = time.perf_counter()
    assert main(["inspect", target, "--world-size", "1024", "--strategy", "fsdp"]) == 0
    elapsed = time.perf_counter() - start
    assert elapsed < budget_s(60), f"dpar inspect took {elapsed:.1f} s"
    out = capsys.readouterr().out
    assert "fsdp on 1024 ranks" in out and "reduce_scatter" in out and "all_gather" in out
    rank0 = 4 * sum(-(-d0 // 1024) * row for d0, row in gpt_shapes())
    assert rank0 == 15_496  # one row of every parameter: 3,874 fp32 elements
    assert f"{rank0:,}" in out and f"{2 * rank0:,}" in out


def test_a_bucket_cap_lays_out_fsdps_buckets_as_parallelize_would():
    """``options={'bucket_cap_mb': ...}`` reaches parallelize under a sharded strategy: consecutive
    parameters up to the cap instead of one bucket per block."""
    cap_bytes = 2 * 4 * BLOCK_ELEMENTS  # two blocks' parameters fill a bucket
    report = explain(*gpt(), world_size=N, strategy="fsdp", options={"bucket_cap_mb": cap_bytes / 2**20})
    gathers = rows(report, "forward graph", "all_gather")
    per_block = rows(gpt_report("fsdp"), "forward graph", "all_gather")
    assert len(gathers) < len(per_block)
    assert sum(c.bytes for c in gathers) == sum(c.bytes for c in per_block)  # every parameter, once
    assert any(len({block_of(p) for p in report.buckets[c.bucket].parameters}) > 1 for c in gathers)
