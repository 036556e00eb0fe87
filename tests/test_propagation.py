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
EXTENDED = {((4, 8, 12), 1, 2, 4)}  # 4 ranks on 3 dims: the 2-rank 3-dim and the 4-rank 2-dim cases cover it


@pytest.mark.parametrize("shape,src,dst,world", [pytest.param(*c, marks=pytest.mark.extended if c in EXTENDED else ())
                                                 for c in CASES], ids=[f"{s}-S{a}-S{b}-{w}ranks" for s, a, b, w in CASES])
def test_shard_to_shard_is_one_all_to_all(shape: tuple[int, ...], src: int, dst: int, world: int) -> None:
    results = run_ranks(_redistributed_on_a_rank, world, shape, Shard(src), Shard(dst))
    print(results[0][1])
    assert all(ok for ok, _ in results)
    code = results[0][1]
    assert code.count("_c10d_functional.all_to_all_single") == 1 and "all_gather" not in code


def _attention_on_rank(mask_shape: tuple[int, ...], rank: int) -> str:
    """One rank's code for attention over 4 heads split 2 ways (q, k, v read through the markers,
    as split parameters are), with an additive mask of ``mask_shape``; fake values only."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dpar.compiler.propagation.localize import localize
    from dpar.compiler.propagation.propagate import MeshDim, propagate_placements

    batch, heads, seq, head_dim, tp = 2, 4, 8, 8, 2

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor]:
        q, k, v = (torch.ops.dpar.tensor_parallel_weight(b, 1, tp, "tp", heads) for b in (q, k, v))
        return (torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask),)

    blocks = [torch.randn(batch, heads // tp, seq, head_dim) for _ in range(3)]
    gm = make_fx(attend, tracing_mode="fake")(*blocks, torch.zeros(mask_shape))
    mesh = MeshDim(size=tp, rank=rank, group_name="tp")
    gm = localize(propagate_placements(gm, mesh), mesh)
    gm.recompile()
    return gm.code


def test_a_mask_broadcast_over_the_split_heads_reaches_attention_whole() -> None:
    """A padding mask (batch, 1, q, k) has one head for all: each rank uses all of it. It used to
    be sliced like q/k/v along dim 1, to ``slice(mask, 1, 0, 0)``, an empty mask the kernel
    broadcast without complaint: wrong attention, no error."""
    code = _attention_on_rank((2, 1, 8, 8), rank=1)
    print(code)
    assert (
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default("
        "q_1, k_1, v_1, attn_mask = mask_1)" in code
    )
    assert "aten.slice" not in code
    assert code.count("all_gather_into_tensor.default(") == 1  # the output, gathered for the graph output


def test_a_mask_with_a_value_per_head_is_sliced_to_this_ranks_heads() -> None:
    """T5's relative position bias (1, heads, q, k): rank 1 takes heads 2 and 3."""
    code = _attention_on_rank((1, 4, 8, 8), rank=1)
    print(code)
    assert "torch.ops.aten.slice.Tensor(mask_1, 1, 2, 4)" in code
    assert "attn_mask = slice_tensor" in code


def _uneven_on_a_rank(rank: int, world_size: int, rows: int) -> tuple[bool, bool, bool]:
    """Shard(0) -> Replicate, Partial -> Shard(0) and Replicate -> Shard(0) of a ``rows``-row tensor
    the degree does not divide, each against torch.chunk's blocks (longer first, the last shorter)."""
    full = torch.randn(rows, 3, generator=torch.Generator().manual_seed(0))
    group = dist.group.WORLD.group_name
    blocks = full.chunk(world_size)

    def moved(src, dst, local: torch.Tensor) -> torch.Tensor:
        graph = fx.Graph()
        value = graph.placeholder("value")
        value.meta["val"] = full
        graph.output(redistribute(graph, value, src, dst, tp=world_size, rank=rank, group_name=group))
        return fx.GraphModule({}, graph)(local)

    gathered = moved(Shard(0), Replicate(), blocks[rank].clone())
    scattered = moved(Partial(), Shard(0), full / world_size)
    sliced = moved(Replicate(), Shard(0), full)
    return (
        torch.equal(gathered, full),
        torch.allclose(scattered, blocks[rank]),
        torch.equal(sliced, blocks[rank]),
    )


@pytest.mark.parametrize("rows,world", [(97, 2), (7, 4)], ids=["97-rows-2-ranks", "7-rows-4-ranks"])
def test_uneven_blocks_are_padded_inside_the_collectives_only(rows: int, world: int) -> None:
    assert all(all(ok) for ok in run_ranks(_uneven_on_a_rank, world, rows))
