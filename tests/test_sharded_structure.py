"""Structure of the zero2/fsdp passes, in one process with the fake process group."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import dpar
from dpar.compiler.collectives import collectives
from fake_world import fake_world
from gpt import GPT, GPTConfig

WORLD = 4
CONFIG = GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=32)


def compiled_graphs(strategy: str, **parallelize_kwargs) -> dict[str, fx.GraphModule]:
    with fake_world(WORLD) as graphs:
        torch.manual_seed(0)
        model = GPT(CONFIG)
        dpar.parallelize(model, strategy=strategy, **parallelize_kwargs)
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        idx = torch.randint(0, 256, (2, 16))
        compiled(idx, idx).backward()
        return {g.label: g.graph for g in graphs}


def kinds(gm: fx.GraphModule) -> list[str]:
    return [c.kind for c in collectives(gm)]


def test_fsdp_gathers_again_in_backward_and_zero2_does_not() -> None:
    fsdp = compiled_graphs("fsdp")
    zero2 = compiled_graphs("zero2")
    blocks = CONFIG.n_layer
    for graphs in (fsdp, zero2):
        assert kinds(graphs["forward graph"]) == ["all_gather"] * (blocks + 1)  # a bucket per block + root
        assert kinds(graphs["backward graph"]).count("reduce_scatter") == blocks + 1
    # fsdp gathers every block again; the root bucket, used last in forward and first in
    # backward, stays gathered across the boundary (as FSDP2 keeps its root).
    assert kinds(fsdp["backward graph"]).count("all_gather") == blocks
    assert kinds(zero2["backward graph"]).count("all_gather") == 0
    # zero2 keeps the gathered block parameters for the backward, fsdp only their shards
    # (both keep the root bucket gathered).
    params = sum(p.numel() * 4 for n, p in GPT(CONFIG).named_parameters() if n.startswith("blocks."))
    extra = saved_bytes(zero2["forward graph"]) - saved_bytes(fsdp["forward graph"])
    print(f"saved for backward: zero2 - fsdp = {extra} B, parameters {params} B")
    assert extra >= (WORLD - 1) / WORLD * params * 0.9


def saved_bytes(forward: fx.GraphModule) -> int:
    """Bytes the forward hands to the backward (every output but the loss)."""
    outputs = forward.graph.output_node().args[0][1:]
    values = {id(n): n.meta["val"] for n in outputs if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)}
    return sum(v.numel() * v.element_size() for v in values.values())


def gathers_in_flight(gm: fx.GraphModule) -> int:
    """The most all-gathers issued and not yet waited for at any point of the graph."""
    outstanding, most = 0, 0
    for node in gm.graph.nodes:
        if node.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
            outstanding += 1
            most = max(most, outstanding)
        elif node.target is torch.ops._c10d_functional.wait_tensor.default and node.args[0].target is torch.ops._c10d_functional.all_gather_into_tensor.default:
            outstanding -= 1
    return most


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_in_flight_limit_bounds_the_gathers_issued_ahead(limit: int) -> None:
    graphs = compiled_graphs("fsdp", max_inflight_gathers=limit)
    for label in ("forward graph", "backward graph"):
        assert gathers_in_flight(graphs[label]) == limit, label


def test_prefetch_issues_the_next_blocks_gather_before_this_blocks_compute() -> None:
    forward = compiled_graphs("fsdp", max_inflight_gathers=2)["forward graph"]
    found = collectives(forward)
    at = {n.name: i for i, n in enumerate(forward.graph.nodes)}
    for current, following in zip(found, found[1:]):
        # The gather of the next bucket is issued before this bucket's data is even waited for.
        assert at[following.issue_node] < at[current.wait_node]
        assert current.compute_between > 0 or current is found[0]


def test_uneven_shards_are_padded_once_and_explain_shows_the_program_that_trains() -> None:
    """Linear(16, 30) -> (30, 5) -> (5, 4) over 4 ranks: two weights and two biases whose rows 4 does not
    divide. Each gradient is padded once before its reduce-scatter (DTensor's own path pads each of the
    4 chunks), and explain's backward is the backward torch.compile trains with, op for op."""
    from collections import Counter

    from models import Uneven

    from dpar.explaining import explain

    def ops(gm: fx.GraphModule) -> Counter:
        return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    with fake_world(WORLD) as graphs:
        model = dpar.parallelize(Uneven(), strategy="fsdp")
        torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(x).sum().backward()
    trained = {g.label: g.graph for g in graphs}["backward graph"]
    uneven = sum(1 for p in Uneven().parameters() if p.shape[0] % WORLD)
    assert uneven == 4
    assert ops(trained)["aten.constant_pad_nd.default"] == uneven  # DTensor's per-chunk path pads 6 here
    reported = next(g for g in explain(Uneven(), (x,), world_size=WORLD, strategy="fsdp").graphs if g.label == "backward graph")
    assert ops(reported.graph) == ops(trained)
