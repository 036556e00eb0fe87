"""Known answers of the planner under fixed α-β constants, and the plan it hands the runtime."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from planner_models import FAST, SLOW, fork, gpt, hardware, mlp

import dpar
from dpar.planner.capture import build_op_graph
from dpar.planner.strategies import evaluate_strategies
from dpar.planning import Plan, plan

WIDE_MLP = dict(hidden=4096, batch=8)  # weights >> activations: tensor parallel
NARROW_MLP = dict(hidden=256, batch=1 << 18)  # activations >> weights, gradients hide behind backward


def _plan_mlp(hidden: int, batch: int, mesh_shape=(8,), links=(FAST,), **kwargs) -> Plan:
    model, inputs = mlp(hidden, batch)
    return plan(model, inputs, mesh_shape=mesh_shape, device=hardware(*links), **kwargs)


def test_small_hidden_large_batch_mlp_is_ddp_with_the_closed_form_all_reduce():
    p = _plan_mlp(**NARROW_MLP)
    assert (p.strategy, p.data_parallel, p.mesh_dim_names) == ("ddp", "replicate", ("dp",))
    assert all(pp.placements == ("R",) for pp in p.parameters)
    # One all-reduce of the four layers' 256x256 + 256 fp32 gradients (the model's dtype) on 8 ranks: 1 MB, one bucket
    # of DDP's 25 MB cap, as the runtime fills its buckets in gradient order.
    alpha, beta = FAST
    payload = 4 * (256 * 256 + 256) * 4
    assert p.cost.dp_comm_s == pytest.approx(2 * 7 * alpha + 2 * 7 / 8 * payload * beta, rel=1e-9)
    assert p.cost.exposed_comm_s == 0.0  # hidden behind the backward
    assert p.count("all_reduce", "dp") == 1
    assert all(pp.comm_bytes == round(2 * 7 / 8 * math.prod(pp.shape) * 4) for pp in p.parameters)


def test_large_hidden_small_batch_mlp_is_column_row_tp_with_l_minus_1_all_reduces():
    layers = 4
    p = _plan_mlp(**WIDE_MLP)
    assert (p.strategy, p.mesh_dim_names, p.data_parallel) == ("tp", ("tp",), "replicate")
    # layers.1 and layers.3 are one representative (repeats collapse with period 2).
    linear = [(o.module, o.choice, o.count) for o in p.ops if o.kind == "linear"]
    assert linear == [("layers.0", "column", 1), ("layers.1", "row", 2), ("layers.2", "column", 1)]
    assert p.count("all_reduce", "tp", "forward") == layers // 2
    assert p.count("all_reduce", "tp", "backward") == layers // 2 - 1  # layer 0's input needs no gradient
    assert p.count("all_reduce", "tp") == layers - 1
    assert p.count("reduce_scatter", "tp") == 0
    # The one all-gather is the batch's: each rank is fed its own rows of x and target (8 x 4096 fp32 each).
    gathers = [(c.phase, c.bytes, c.where) for c in p.collectives if c.kind == "all_gather"]
    assert gathers == [("forward", 2 * 8 * 4096 * 4, "the batch: the tp group's slices")]
    dims = p.tp_dims()
    assert [dims[f"layers.{i}.weight"] for i in range(layers)] == [0, 1, 0, 1]
    assert [dims[f"layers.{i}.bias"] for i in range(layers)] == [0, None, 0, None]


def test_memory_budget_below_the_replicated_footprint_turns_ddp_into_fsdp():
    model, inputs = mlp(**NARROW_MLP)
    strategies = evaluate_strategies(build_op_graph(model, inputs), (8,), hardware(FAST))
    memory = {name: strategies[name].cost.memory_bytes_per_rank for name in ("ddp", "zero2", "fsdp", "tp")}
    budget = memory["fsdp"] + (memory["zero2"] - memory["fsdp"]) / 2
    assert budget < min(memory["ddp"], memory["zero2"], memory["tp"])
    p = _plan_mlp(**NARROW_MLP, memory_budget_gb=budget / 1e9)
    assert (p.strategy, p.data_parallel) == ("fsdp", "fsdp")
    assert p.cost.memory_bytes_per_rank <= budget
    assert all(pp.placements == ("S(0)",) for pp in p.parameters)
    # ZeRO-3: 16Ψ/N per parameter (2 bf16 + 2 grad + 12 fp32 optimizer bytes, over 8 ranks).
    assert all(pp.memory_bytes == round(16 * math.prod(pp.shape) / 8) for pp in p.parameters)
    assert _plan_mlp(**NARROW_MLP).parameters[0].memory_bytes == 16 * 256 * 256  # replicated: 16Ψ


def test_memory_budget_nothing_fits_names_the_smallest_footprint_and_the_fix():
    with pytest.raises(dpar.OptionsError, match=r"no plan fits memory_budget_gb=0\.0001: the smallest footprint found is") as err:
        _plan_mlp(**NARROW_MLP, memory_budget_gb=1e-4)
    assert "raise memory_budget_gb to at least that" in str(err.value)
    assert "bigger mesh_shape" in str(err.value)


@pytest.mark.parametrize(("links", "roles"), [((SLOW, FAST), ("dp", "tp")), ((FAST, SLOW), ("tp", "dp"))])
def test_2d_mesh_puts_dp_on_the_slow_axis_and_tp_on_the_fast_one(links, roles):
    p = _plan_mlp(hidden=4096, batch=6144, mesh_shape=(2, 4), links=links)  # 6144: the batch gather tips it to dp
    assert p.mesh_dim_names == roles
    tp_axis = roles.index("tp")
    assert {pp.placements[tp_axis] for pp in p.parameters} == {"S(0)", "S(1)", "R"}
    assert p.strategy.endswith("+tp")


def _assert_planner_beats_every_strategy(model, inputs, mesh_shape, links) -> dict[str, float]:
    hw = hardware(*links)
    best = plan(model, inputs, mesh_shape=mesh_shape, device=hw)
    strategies = evaluate_strategies(build_op_graph(model, inputs), mesh_shape, hw)
    steps = {name: s.cost.step_s for name, s in strategies.items() if isinstance(s, Plan)}
    for name, step in steps.items():
        assert best.cost.step_s <= step * (1 + 1e-9), (name, best.cost.step_s, step)
    return steps


@pytest.mark.parametrize(("mesh_shape", "links"), [((8,), (FAST,)), ((2, 4), (SLOW, FAST))])
def test_planner_is_no_worse_than_any_hand_written_strategy_on_an_mlp(mesh_shape, links):
    model, inputs = mlp(hidden=2048, batch=512)
    steps = _assert_planner_beats_every_strategy(model, inputs, mesh_shape, links)
    expected = {"ddp", "zero2", "fsdp", "tp"} if len(mesh_shape) == 1 else {"ddp", "zero2", "fsdp", "ddp+tp", "zero2+tp", "fsdp+tp"}
    assert set(steps) == expected


@pytest.mark.parametrize(("mesh_shape", "links"), [((8,), (FAST,)), ((2, 4), (SLOW, FAST))])
def test_planner_is_no_worse_than_any_hand_written_strategy_on_a_gpt(mesh_shape, links):
    model, inputs = gpt(n_layer=4, n_embd=512, n_head=8, block=256, vocab=8192, batch=8)
    steps = _assert_planner_beats_every_strategy(model, inputs, mesh_shape, links)
    data = {"ddp", "zero2", "fsdp"}  # the GPT has attention: the cp strategies apply too (the MLP above has none)
    expected = {*data, "tp", "cp"} if len(mesh_shape) == 1 else {*data, *(f"{d}+{a}" for d in data for a in ("tp", "cp"))}
    assert set(steps) == expected


def test_hand_written_tp_on_a_gpt_is_megatron():
    model, inputs = gpt(n_layer=2)
    p = evaluate_strategies(build_op_graph(model, inputs), (8,), hardware(FAST))["tp"]
    dims = p.tp_dims()
    assert [dims[f"blocks.1.attn.{n}.weight"] for n in ("q", "k", "v", "proj")] == [0, 0, 0, 1]
    assert [dims[f"blocks.1.mlp.{n}.weight"] for n in ("up", "down")] == [0, 1]
    assert dims["tok_emb.weight"] == 0  # vocab-parallel, shared with the column LM head
    assert dims["blocks.0.ln_attn.weight"] is None
    # Per block: all-reduce after attn.proj and mlp.down, and of the input gradients of q|k|v and up.
    blocks = 2
    assert p.count("all_reduce", "tp", "backward") == 2 * blocks + 1  # + ln_f's, below the LM head
    assert p.count("all_reduce", "tp", "forward") == 2 * blocks + 2 + 3  # + both embeddings + loss statistics


def test_plan_round_trips_through_json_and_its_table_lists_every_parameter():
    model, inputs = gpt(n_layer=2)
    p = plan(model, inputs, mesh_shape=(2, 4), device=hardware(SLOW, FAST))
    again = Plan.from_json(p.to_json())
    assert again == p
    table = str(p)
    names = [n for n, _ in model.named_parameters()]
    assert [pp.name for pp in p.parameters] == names
    assert all(name in table for name in names)
    assert "step" in table and "exposed comm" in table


@pytest.mark.parametrize("build", [lambda: mlp(hidden=1024, batch=256, layers=3), lambda: fork(hidden=1024, batch=64)])
@pytest.mark.parametrize(("mesh_shape", "links"), [((8,), (FAST,)), ((2, 4), (SLOW, FAST))])
def test_ilp_optimum_equals_brute_force_over_every_assignment(mesh_shape, links, build):
    """The linearisation (edge products, per-placement gradient sums, overlap) is exact; a tp
    axis that splits no parameter is not a tp plan (it is one of the dp layouts)."""
    from dpar.planner.evaluate import Assignment, evaluate
    from dpar.planner.layout import layouts
    from dpar.planner.rules import candidates

    model, inputs = build()
    graph, hw = build_op_graph(model, inputs), hardware(*links)

    def splits(layout, choices) -> bool:
        picked = [candidates(op, layout.tp_degree)[c] for op, c in zip(graph.ops, choices)]
        return layout.tp_degree == 1 or any(cand.splits_a_parameter for cand in picked)

    best = min(
        evaluate(graph, Assignment(layout, choices), hw).cost.step_s
        for layout in layouts(mesh_shape, None)
        for choices in itertools.product(*(range(len(candidates(op, layout.tp_degree))) for op in graph.ops))
        if splits(layout, choices)
    )
    assert plan(model, inputs, mesh_shape=mesh_shape, device=hw).cost.step_s == pytest.approx(best, rel=1e-6)


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_a_forward_run_under_autocast_is_priced_by_the_ops_inside_it(autocast_dtype):
    """Export keeps a forward run under ``torch.autocast`` as one higher-order op over a submodule; the planner
    prices the ops inside it (it priced one op of no FLOPs and no activations): the GPT called under a disabled
    autocast has the op graph of the GPT called plainly, op for op (names aside); under bf16 autocast the same FLOPs,
    its Linears computing in bf16."""
    from gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=64))  # on the CPU, where autocast acts
    inputs = (torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))

    class Called(torch.nn.Module):
        def __init__(self, autocast: bool) -> None:
            super().__init__()
            self.inner, self.autocast = model, autocast

        def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            if not self.autocast:
                return self.inner(ids, targets)
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                return self.inner(ids, targets)

    plain, under = build_op_graph(Called(False), inputs), build_op_graph(Called(True), inputs)
    flops = lambda graph: sum(op.flops * op.count for op in graph.ops)  # noqa: E731
    assert flops(plain) > 0 and flops(under) == flops(plain)
    linears = {op.dtype for op in under.ops if op.kind == "linear"}
    if autocast_dtype is None:
        assert [dataclasses.replace(op, name="") for op in under.ops] == [dataclasses.replace(op, name="") for op in plain.ops]
    else:
        assert linears == {torch.bfloat16}
