"""Sharding propagation's parts on their own: view mapping, redistribution costs, and the collectives
a redistribution inserts, run on gloo ranks against slicing the full tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from distributed import run_ranks
from dpar.compiler.propagation.redistribute import LATENCY_BYTES, SLICE_COST, cost, redistribute
from dpar.compiler.propagation.rules import view_dim, view_groups


def test_views_pair_runs_of_dimensions_and_keep_a_shard_on_the_outer_one() -> None:
    assert view_groups((2, 16, 32), (32, 32)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((2, 16, 32), (2, 16, 4, 8)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert view_dim((2, 16, 32), (2, 16, 4, 8), 2, tp=2) == 2  # hidden -> heads: the heads are split
    assert view_dim((2, 16, 32), (32, 32), 0, tp=2) == 0  # batch stays outermost when flattened with seq
    assert view_dim((2, 16, 32), (32, 32), 1, tp=2) is None  # seq is inner in (batch * seq): not a block
    assert view_dim((2, 16, 32), (2, 16, 4, 8), 2, tp=8) is None  # 4 heads cannot split 8 ways


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_costs_are_ring_bytes_plus_one_latency(tp: int) -> None:
    nbytes = 1 << 20
    share = (tp - 1) / tp * nbytes
    assert cost(Partial(), Replicate(), nbytes, tp) == 2 * share + LATENCY_BYTES  # all-reduce
    assert cost(Partial(), Shard(1), nbytes, tp) == share + LATENCY_BYTES  # reduce-scatter
    assert cost(Shard(0), Replicate(), nbytes, tp) == share + LATENCY_BYTES  # all-gather
    assert cost(Shard(0), Shard(1), nbytes, tp) == share / tp + LATENCY_BYTES  # all-to-all: each rank's block
    assert cost(Replicate(), Shard(0), nbytes, tp) == SLICE_COST
    assert cost(Shard(0), Shard(0), nbytes, tp) == 0.0


def _redistributed_on_a_rank(
    rank: int, world_size: int, shape: tuple[int, ...], src: Shard, dst: Shard
) -> tuple[bool, str]:
    """Whether ``src -> dst`` of this rank's block of a seeded tensor gives its ``dst`` block; the graph."""
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    graph = fx.Graph()
    value = graph.placeholder("block")
    value.meta["val"], value.meta["placement"] = full, src  # propagation reads global shapes
    moved = redistribute(
        graph, value, src, dst, tp=world_size, rank=rank, group_name=dist.group.WORLD.group_name
    )
    graph.output(moved)
    gm = fx.GraphModule({}, graph)
    result = gm(full.chunk(world_size, src.dim)[rank].contiguous())
    return torch.equal(result, full.chunk(world_size, dst.dim)[rank]), gm.code


CASES = [((8, 12), 0, 1, 2), ((8, 12), 1, 0, 4), ((4, 8, 12), 2, 1, 2), ((4, 8, 12), 1, 2, 4), ((4, 8, 12), 0, 2, 2)]


@pytest.mark.parametrize("shape,src,dst,world", CASES, ids=[f"{s}-S{a}-S{b}-{w}ranks" for s, a, b, w in CASES])
def test_shard_to_shard_is_one_all_to_all(shape: tuple[int, ...], src: int, dst: int, world: int) -> None:
    results = run_ranks(_redistributed_on_a_rank, world, shape, Shard(src), Shard(dst))
    print(results[0][1])
    assert all(ok for ok, _ in results)
    code = results[0][1]
    assert code.count("_c10d_functional.all_to_all_single") == 1 and "all_gather" not in code
