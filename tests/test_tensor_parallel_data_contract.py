"""Tensor parallel under DDP's data contract: each rank fed its own rows, parameters as torch DDP's.

See [Note: the data contract under tensor parallel] in compiler/passes/group_batch.py.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dpar
from dpar.compiler.registry import CompiledGraph
from distributed import RankFailed, run_ranks
from models import ConvBN

STEPS = 4
ROWS_PER_RANK = 3


class MaskedMLP(nn.Module):
    """The loss is inside the graph and averages over the rows a mask keeps: a rank's own
    mean differs from the mean over the group's rows when ranks keep different counts."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        error = ((self.down(F.gelu(self.up(x))) - y) ** 2).mean(-1)
        return (error * keep).sum() / keep.sum()


def _batch(model: str, step: int, rank: int, world: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(10 * step + 1)
    rows = ROWS_PER_RANK * world
    if model == "convbn":
        x, y = torch.randn(rows, 3, 8, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)
        return x.chunk(world)[rank], y.chunk(world)[rank]
    x, y = torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)
    keep = torch.ones(rows)
    keep[1::ROWS_PER_RANK * 2] = 0.0  # rank 0 keeps 2 of its 3 rows, rank 1 all 3 (world 2)
    return x.chunk(world)[rank], y.chunk(world)[rank], keep.chunk(world)[rank]


def _loss(model_name: str, runner: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if model_name == "convbn":
        x, y = batch
        return F.cross_entropy(runner(x), y)
    return runner(*batch)


def _train(rank: int, world: int, model_name: str, strategy: str, **kwargs: object) -> dict:
    torch.manual_seed(0)
    model = MaskedMLP() if model_name == "masked_mlp" else ConvBN()
    if strategy == "torch_ddp":
        runner = nn.parallel.DistributedDataParallel(model)
    else:
        example = _batch(model_name, 0, rank, world)
        dpar.parallelize(model, strategy=strategy, example_inputs=example if model_name == "masked_mlp" else example[:1], **kwargs)
        runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = _loss(model_name, runner, _batch(model_name, step, rank, world))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = model.state_dict() if strategy == "torch_ddp" else dpar.checkpoint.full_state_dict(model)
    # Buffers are per rank (BatchNorm's running statistics): every rank reports its own.
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    state = {k: v.detach().clone() for k, v in (state or {}).items()}  # full_state_dict: rank 0 only
    return {"state": state, "buffers": buffers, "losses": losses}


def _both(rank: int, world: int, model_name: str, strategy: str) -> tuple[dict, dict]:
    return _train(rank, world, model_name, "torch_ddp"), _train(rank, world, model_name, strategy)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()), default=0.0)


@pytest.mark.parametrize("model_name", ["masked_mlp", "convbn"])
def test_tp_on_per_rank_slices_matches_torch_ddp(model_name: str) -> None:
    """Parameters (rank 0's gathered view), every rank's buffers and every rank's own loss equal DDP's."""
    results = run_ranks(_both, 2, model_name, "tp", timeout_s=240)
    reference, tp = results[0]
    diff = _max_diff(reference["state"], tp["state"])
    print(f"tp on per-rank slices, {model_name}: max |parameter difference| from torch DDP {diff:.2e}")
    assert diff <= 1e-5
    for rank, (ref_rank, tp_rank) in enumerate(results):
        assert _max_diff(ref_rank["buffers"], tp_rank["buffers"]) <= 1e-5, f"rank {rank}'s buffers"
        assert ref_rank["losses"] == pytest.approx(tp_rank["losses"], abs=1e-5), f"rank {rank}'s own losses"
    assert results[0][1]["losses"] != pytest.approx(results[1][1]["losses"])  # each rank saw its own rows


def _same_rows(rank: int, world: int, differ: bool) -> float:
    torch.manual_seed(0)
    model = MaskedMLP()
    x, y, keep = _batch("masked_mlp", 0, 0, world)  # rank 0's rows on every rank
    if differ and rank == 1:
        x = x + 1.0
    dpar.parallelize(model, strategy="tp", example_inputs=(x, y, keep), same_batch_in_tp_group=True)
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    start = time.monotonic()
    runner(x, y, keep).backward()
    return time.monotonic() - start


def test_same_batch_in_tp_group_is_checked() -> None:
    run_ranks(_same_rows, 2, False, timeout_s=120)  # the promise holds: trains
    with pytest.raises(RankFailed, match=r"BatchMismatchError.*input 0 on ranks \[1\] differs from rank 0"):
        run_ranks(_same_rows, 2, True, timeout_s=120)


def _most_copy_gradients_alive(graph: torch.fx.Graph) -> int:
    """The most per-copy parameter gradients (the operands of the copies' mean) alive at one point of ``graph``."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    adds = [n for n in nodes if n.target is torch.ops.aten.add.Tensor]
    means = [n for n in nodes if n.target is torch.ops.aten.div.Scalar and n.args[1] == 4]
    chain = {n for n in adds if any(m in n.users for m in means) or any(u in adds for u in n.users)}
    copies = {a for n in chain for a in n.args if isinstance(a, torch.fx.Node) and a not in chain}
    spans = [(position[c], max(position[u] for u in c.users)) for c in copies]
    return max(sum(start <= i < end for start, end in spans) for i in range(len(nodes)))


def test_unrolled_gradients_are_added_in_as_each_copy_computes_them() -> None:
    """A tp group of 4 runs the backward 4 times, once per rank's rows: each copy's parameter gradients are
    added into the running sum as soon as they exist (summed at the end, all 4 copies' gradients of every
    parameter stayed alive until then: 16 for this MLP's 4 parameters; now 5)."""
    from fake_world import fake_world

    torch.manual_seed(0)
    model = MaskedMLP()
    x, y, keep = _batch("masked_mlp", 0, 0, 4)
    with fake_world(4) as graphs:
        dpar.parallelize(model, strategy="tp", example_inputs=(x, y, keep))
        runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        runner(x, y, keep).backward()
    (backward,) = (c for c in graphs if c.label.startswith("backward"))
    parameters = sum(1 for _ in model.parameters())
    assert _most_copy_gradients_alive(backward.graph.graph) <= 2 * parameters


def _gpt_backward_under_copies(world: int, n_layer: int, strategy: str, **options: object) -> CompiledGraph:
    """The backward graph of the example GPT (``n_layer`` blocks) under ``strategy`` on a fake world of ``world``
    ranks, each rank fed its own rows (so a tp group runs copies); a 2-D strategy on a (world / 2, 2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from fake_world import fake_world
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=n_layer, n_head=2, n_embd=32))
    x = torch.randint(0, 256, (2, 16))
    with fake_world(world) as graphs:
        if "+" in strategy:
            options["mesh"] = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dpar.parallelize(model, strategy=strategy, example_inputs=(x, x), **options)
        torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(x, x).backward()
    (backward,) = (c for c in graphs if c.label.startswith("backward"))
    return backward


def test_copies_run_block_by_block_so_gradient_reductions_overlap_the_backward() -> None:
    """zero2+tp on 2 x 2 (fake world): the copies run each block's backward in turn, so the last block's gradients
    are complete, and reduce-scattered, before any copy runs the first block's backward; each bucket's reduction
    overlaps compute, and the copies' shards are not summed with zeros after it (which pinned its wait there)."""
    from dpar.compiler.passes.recompute import block_path
    from dpar.compiler.propagation.redistribute import ACTIVATION_COLLECTIVE

    backward = _gpt_backward_under_copies(4, 3, "zero2+tp")
    nodes = list(backward.graph.graph.nodes)
    first_block = min(i for i, n in enumerate(nodes)  # the first block's first matmul of a backward
                      if n.target is torch.ops.aten.mm.default and block_path(n, "fwd_nn_module_stack") == "blocks.0")
    scatters = [i for i, n in enumerate(nodes) if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default
                and not n.meta.get(ACTIVATION_COLLECTIVE)]
    assert len(scatters) == 4  # a bucket a block, and the root's
    assert scatters[0] < first_block
    overlapped = {c.issue_node: c.compute_between for c in backward.collectives}
    assert all(overlapped[nodes[i].name] > 0 for i in scatters[:-1])
    assert not any(n.target is torch.ops.aten.full.default for n in nodes)


def test_copies_gather_the_token_stream_again_where_the_backward_needs_it() -> None:
    """tp + sequence parallel, each rank's own rows (copies): the backward gathers each block's token stream again
    right before the matmuls that read it ([Note: recomputation where it is needed]), not every copy's at the top
    of the backward, where all of them lived through it."""
    nodes = list(_gpt_backward_under_copies(2, 2, "tp", sequence_parallel=True).graph.graph.nodes)
    gathers = [i for i, n in enumerate(nodes)
               if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default and n.meta["val"].dim() >= 2]
    matmuls = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    assert len(gathers) >= 2 * 2 * 2  # per copy, per block: before attention and before the MLP
    assert sum(i < matmuls[0] for i in gathers) <= 1


def test_copies_recompute_each_checkpointed_block_where_its_backward_runs() -> None:
    """tp with each rank's own rows and full recomputation: the backward recomputes the first block's forward after it
    has run the last block's gradients, not all blocks at its top (where every recomputed block lived through the
    backward: Llama-3-8B cut to 4 layers, zero2+tp on 8 x 8, held 7.89 GB on its graphs, now 2.96)."""
    from dpar.compiler.passes.recompute import BLOCK_KEY, block_path

    nodes = list(_gpt_backward_under_copies(2, 3, "tp", activation_checkpointing="full").graph.graph.nodes)
    recomputed = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.meta.get(BLOCK_KEY) == "blocks.0"]
    last_block_gradient = min(i for i, n in enumerate(nodes)
                              if n.target is torch.ops.aten.mm.default and block_path(n, "fwd_nn_module_stack") == "blocks.2")
    assert recomputed and min(recomputed) > last_block_gradient


def test_unrolled_graph_gathers_inputs_and_tangents_once(world_of_two: list) -> None:
    """One process, fake group of 2: the forward gathers each input once and runs two copies;
    the backward gathers the tangent once; every parameter gradient is the copies' mean."""
    torch.manual_seed(0)
    model = MaskedMLP()
    x, y, keep = _batch("masked_mlp", 0, 0, 2)
    dpar.parallelize(model, strategy="tp", example_inputs=(x, y, keep))
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    runner(x, y, keep).backward()
    forward, backward = (c for c in world_of_two if c.label.startswith(("forward", "backward")))
    print(forward.graph.code)
    gathers = [c for c in forward.collectives if c.kind == "all_gather"]
    assert sorted(c.shape for c in gathers) == sorted([("3",), ("3", "16"), ("3", "4")])  # this rank's keep, x, y
    assert sum(c.kind == "all_reduce" for c in forward.collectives) == 2  # one row-parallel sum per copy
    assert [c.shape for c in backward.collectives if c.kind == "all_gather"] == [("1",)]  # this rank's loss tangent
    assert str(forward.graph.code).count("dpar.pick_own") == 1  # this rank's loss, read from both copies
    assert "dpar.own_rows" not in str(forward.graph.code) + str(backward.graph.code)
    assert dist.get_world_size() == 2
