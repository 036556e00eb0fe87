"""The planner chooses activation checkpointing with the placements: known answers on a model small enough to count by hand.

``Residual`` stacks ``N`` blocks ``x + fc2(gelu(fc1(x))`` on a (B, h) batch. Per block, with
``u = B h 4 / D`` fp32 bytes of one (B, h) activation on one of D data-parallel ranks, the cost
model counts what the backward reads: ``fc1``'s output (gelu's backward reads it), ``gelu``'s
(fc2's weight gradient reads it) and the residual add's (the next fc1's weight gradient, or the
loss, reads it); ``fc2``'s output is read by no backward: 3u (keep). Selective recomputes the
gelu (the add is the next block's checkpoint, so it stays): 2u a block, plus one gelu live again
while its block runs its backward, u. Full keeps only the add: u a block, plus fc1 and gelu live
again, 2u. See [Note: pricing recomputation] in planner/activations.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from planner_models import FAST, fork, gpt, hardware

import dpar
from dpar.core.plan import ActivationPolicy, Recompute
from dpar.planner.capture import build_op_graph
from dpar.planner.layout import layouts
from dpar.planner.plan import Plan, policy_label
from dpar.planner.solver import smallest_footprint
from dpar.planning import plan

N, B, H, D = 4, 16384, 256, 4
U = B * H * 4 / D  # one (B, h) activation, fp32, on one of D ranks
PSI = N * 2 * (H * H + H)  # parameters
FSDP_STATE = 16 * PSI / D  # fp32 parameter, gradient and AdamW's two moments, over D
SAVED_UNITS = {Recompute.KEEP: 3 * N, Recompute.SELECTIVE: 2 * N + 1, Recompute.FULL: N + 2}
SLACK = 64  # bytes: the scalar loss and rounding


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Residual(nn.Module):
    def __init__(self, hidden: int, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(x, target)


def residual() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    with torch.device("meta"):
        return Residual(H, N), (torch.empty(B, H), torch.empty(B, H))


def _units(policy: ActivationPolicy) -> int:
    """Saved units of a policy whose first k blocks are heavier (see the tests' docstrings)."""
    k = len(policy.blocks)
    if not k:
        return SAVED_UNITS[policy.default]
    return SAVED_UNITS[policy.default] - (k - 1)


def _plan(budget_bytes: float | None) -> Plan:
    model, inputs = residual()
    return plan(model, inputs, mesh_shape=(D,), device=hardware(FAST),
                memory_budget_gb=None if budget_bytes is None else budget_bytes / 1e9)


def _fsdp_footprint(recompute: Recompute) -> float:
    """The least memory per rank under ``recompute``, by hand: fsdp's state and the saved units."""
    return FSDP_STATE + SAVED_UNITS[recompute] * U


def test_the_smallest_footprints_are_the_hand_counted_ones():
    graph = build_op_graph(*residual())
    for recompute in Recompute:
        least, layout = smallest_footprint(graph, layouts((D,), None), hardware(FAST), recompute)
        assert layout.data_parallel == "fsdp"
        assert least == pytest.approx(_fsdp_footprint(recompute), abs=SLACK), recompute


def test_a_budget_that_fits_keeps_everything():
    free = _plan(None)  # no budget: keep, the fastest placements
    assert free.activations.default is Recompute.KEEP and free.cost.recompute_s == 0
    roomy = _plan(free.cost.memory_bytes_per_rank)
    assert roomy.activations.default is Recompute.KEEP
    assert roomy.strategy == free.strategy
    assert roomy.cost.memory_bytes_keep == roomy.cost.memory_bytes_per_rank


def _mixed(k: int, lighter: Recompute = Recompute.SELECTIVE, heavier: Recompute = Recompute.FULL) -> ActivationPolicy:
    """``lighter``, with the first ``k`` blocks under ``heavier``."""
    return ActivationPolicy(lighter, tuple((f"layers.{i}", heavier) for i in range(k)))


def test_tighter_budgets_pick_selective_then_full_blocks_then_fsdp_with_full():
    """Between two policies, the first k blocks under the heavier. A selective block saves u over keep but the
    block recomputed in the backward then holds u more: the first gains nothing, each next one u. A full block
    saves u over selective and holds 2u instead of u: the first gains nothing, each next one u."""
    keep, selective, full = (_fsdp_footprint(r) for r in (Recompute.KEEP, Recompute.SELECTIVE, Recompute.FULL))
    assert full < selective < keep
    answers = {
        keep - U / 2: _mixed(2, Recompute.KEEP, Recompute.SELECTIVE),  # keep fits nowhere: two selective blocks
        keep - 3 * U / 2: _mixed(3, Recompute.KEEP, Recompute.SELECTIVE),
        selective + U / 2: ActivationPolicy(Recompute.SELECTIVE),  # three selective blocks are not enough
        selective - U / 2: _mixed(2),  # selective fits nowhere: two full blocks
        selective - 3 * U / 2: _mixed(3),
        full + SLACK: ActivationPolicy(Recompute.FULL),  # the tightest that fits
    }
    for budget, policy in answers.items():
        p = _plan(budget)
        assert p.activations == policy, budget
        assert Plan.from_json(p.to_json()) == p
        assert p.cost.memory_bytes_per_rank <= budget
        assert p.cost.memory_bytes_keep > budget  # the same placements would not fit keeping everything
        assert p.cost.recompute_s > 0
        assert p.cost.step_s == pytest.approx(p.cost.compute_s + p.cost.recompute_s + p.cost.exposed_comm_s)
        fits = {o.policy: o.fits for o in p.policies}
        assert fits[Recompute.KEEP.value] is False and fits[policy_label(policy)] is True
        assert p.cost.activation_bytes_per_rank == pytest.approx(_units(policy) * U, abs=SLACK)
        assert min((o for o in p.policies if o.fits), key=lambda o: o.step_s).policy == policy_label(policy)
    tightest = _plan(full + SLACK)
    assert (tightest.strategy, tightest.data_parallel) == ("fsdp", "fsdp")
    assert tightest.cost.activation_bytes_per_rank == pytest.approx(SAVED_UNITS[Recompute.FULL] * U, abs=SLACK)


def test_recompute_time_is_the_recomputed_ops_forward():
    """On 100 TFLOP/s and 1 TB/s every op here is memory-bound: an fp32 gelu reads and writes (B/D, h) once."""
    gelu = 2 * B / D * H * 4 / 1e12
    p = _plan(_fsdp_footprint(Recompute.SELECTIVE) + U / 2)
    assert p.activations.default is Recompute.SELECTIVE
    assert p.cost.recompute_s == pytest.approx(N * gelu, rel=1e-6)


def test_an_impossible_budget_names_the_smallest_that_fits_with_full_recompute():
    least = _fsdp_footprint(Recompute.FULL)
    with pytest.raises(dpar.OptionsError, match="no plan fits") as err:
        _plan(least * 0.9)
    message = str(err.value)
    assert "activation checkpointing full" in message and "fsdp" in message
    named = float(re.search(r"smallest footprint found is ([0-9.e+-]+) GB", message).group(1)) * 1e9
    assert named == pytest.approx(least, rel=5e-3)  # printed to 3 digits
    assert _plan(least + SLACK).activations.default is Recompute.FULL


def test_the_plan_prints_why_and_its_json_keeps_the_policy():
    p = _plan(_fsdp_footprint(Recompute.SELECTIVE) + U / 2)
    text = str(p)
    assert "activations: selective in every block" in text
    assert "activation policies: the fastest plan that fits wins" in text
    assert "memory per rank, keep vs chosen" in text and "recompute added to the step" in text
    back = Plan.from_json(p.to_json())
    assert back == p
    assert json.loads(p.to_json())["activations"]["default"] == "selective"


def test_without_a_budget_a_gpt_keeps_everything_and_round_trips():
    model, inputs = gpt(n_layer=2)
    p = plan(model, inputs, mesh_shape=(4,), device=hardware(FAST))
    assert p.activations.default is Recompute.KEEP and [o.policy for o in p.policies] == ["keep"]
    assert Plan.from_json(p.to_json()) == p


def test_a_model_without_blocks_has_nothing_to_recompute():
    model, inputs = fork(64, 8)
    p = plan(model, inputs, mesh_shape=(4,), device=hardware(FAST), memory_budget_gb=1.0)
    assert [o.policy for o in p.policies] == ["keep"]


def test_under_tensor_parallel_the_ilp_and_the_priced_plan_count_the_same_bytes():
    """A recomputed op's tp input is an all-gather's result, saved (collectives are never recomputed): the ILP
    prices it on its edge variables, the plan on the chosen pair; the least footprint of each policy fits as priced."""
    model, inputs = residual()
    graph = build_op_graph(model, inputs)
    tp_only = layouts((D,), ("tp",))
    least = {r: smallest_footprint(graph, tp_only, hardware(FAST), r) for r in Recompute}
    for recompute, (bytes_, layout) in least.items():
        assert layout.roles == ("tp",)
        p = plan(model, inputs, mesh_shape=(D,), mesh_dim_names=("tp",), device=hardware(FAST),
                 memory_budget_gb=bytes_ * (1 + 1e-9) / 1e9)
        assert p.cost.memory_bytes_per_rank <= bytes_ * (1 + 1e-9), recompute
    with pytest.raises(dpar.OptionsError, match="no plan fits"):
        plan(model, inputs, mesh_shape=(D,), mesh_dim_names=("tp",), device=hardware(FAST),
             memory_budget_gb=min(b for b, _ in least.values()) * (1 - 1e-3) / 1e9)


def test_parallelize_applies_the_plans_mixed_policy_by_the_block_names_it_gives():
    """The plan names blocks as parallelize does (an unknown block would be an ActivationPolicyError), and
    ``parallelize(plan=...)`` records the plan's policy for the backend's recompute pass."""
    from fake_world import fake_world

    budget = _fsdp_footprint(Recompute.SELECTIVE) - 3 * U / 2  # three full blocks, the last selective
    p = _plan(budget)
    assert p.activations == _mixed(3)
    with fake_world(D):
        with torch.device("meta"):
            model = Residual(H, N)
        dpar.parallelize(model, plan=p)
        assert dpar.core.plan.plan_of_model(model).activations == p.activations
