"""The planner under the data contract: each rank is fed its own slice of the global batch.

A ``tp`` axis that splits no parameter is a data-parallel axis ([Note: which mesh axes split
the data] in ``planner/plan.py``); ``strategy="auto"`` plans for the global batch of
every rank's slice; the parameters come out as torch DDP's on the same slices (2 gloo ranks).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from planner_models import FAST, SLOW, gpt, hardware, mlp
from torch.testing._internal.distributed.fake_pg import FakeStore

import dpar
from distributed import run_ranks
from dpar.planning import Plan, global_batch, plan
from training import STEPS, TOLERANCE, Case, loss_of, make_optimizer, max_abs_diff, seeded_model
from training import global_batch as batch_of

DATA_PARALLEL = ("ddp", "zero2", "fsdp")
# Rows per rank at which the H100 model prefers data parallel for the test models (their
# compute must outweigh a collective's latency; with fewer rows it splits a layer instead).
ROWS_PER_RANK = {"gpt": 256, "mlp": 8192}


def _unsplit_tp(p: Plan, axis: int, strategy: str) -> Plan:
    """``p`` hand-edited so that mesh axis ``axis`` is called ``tp`` but splits nothing."""
    names = tuple("tp" if i == axis else n for i, n in enumerate(p.mesh_dim_names))
    parameters = tuple(
        dataclasses.replace(pp, placements=tuple("R" if i == axis else x for i, x in enumerate(pp.placements)))
        for pp in p.parameters
    )
    return dataclasses.replace(p, mesh_dim_names=names, strategy=strategy, parameters=parameters)


def _splits_a_parameter_on_tp(p: Plan) -> bool:
    return "tp" not in p.mesh_dim_names or any(d is not None for d in p.tp_dims().values())


# Structure: one process.


@pytest.mark.parametrize(
    "build", [lambda: gpt(n_layer=2, n_embd=32, n_head=2, block=16, vocab=256, batch=4), lambda: mlp(hidden=16, batch=4)]
)
def test_planner_never_gives_a_tp_axis_that_splits_nothing(build):
    """These tiny models used to get a ``tp`` axis replicating every op (no collective at all)."""
    model, inputs = build()
    for mesh_shape, names in (((2,), None), ((2,), ("tp",)), ((2, 4), None), ((2, 4), ("dp", "tp"))):
        p = plan(model, inputs, mesh_shape=mesh_shape, mesh_dim_names=names)
        assert _splits_a_parameter_on_tp(p), (mesh_shape, names, p.strategy)
        assert p.as_run() is p


def test_a_tp_axis_that_splits_nothing_runs_as_data_parallel_over_every_axis():
    model, inputs = mlp(hidden=256, batch=1 << 12)
    # A budget replicated state does not meet (ddp's 7.9 MB a rank, zero2's 5.2 MB) makes it zero2.
    zero2 = plan(model, inputs, mesh_shape=(2, 4), mesh_dim_names=("dp", "dp"), device=hardware(SLOW, FAST),
                 memory_budget_gb=0.0065)
    assert zero2.data_parallel == "zero2"
    run = _unsplit_tp(zero2, 1, "zero2+tp").as_run()
    assert (run.mesh_dim_names, run.strategy, run.data_axes, run.data_parallel_degree) == (("dp", "dp"), "zero2", (0, 1), 8)
    assert {pp.placements for pp in run.parameters} == {("S(0)", "S(0)")}
    model, inputs = mlp(hidden=256, batch=1 << 18)  # test_planner.py: ddp, its all-reduce hidden
    ddp = plan(model, inputs, mesh_shape=(8,), device=hardware(FAST))
    run = _unsplit_tp(ddp, 0, "tp").as_run()
    assert (run.mesh_dim_names, run.strategy, run.tp_dims()) == (("dp",), "ddp", ddp.tp_dims())


def test_printout_names_the_axes_that_split_the_data():
    model, inputs = mlp(hidden=256, batch=1 << 12)
    text = str(plan(model, inputs, mesh_shape=(2,), mesh_dim_names=("dp",), device=hardware(FAST)))
    assert "data split over: dp (2); global batch 4096 rows, 2048 per data-parallel rank" in text
    assert "axis 0 dp (2): data parallel: ranks see different rows, gradients averaged" in text
    model, inputs = mlp(hidden=4096, batch=4096)
    p = plan(model, inputs, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"), device=hardware(SLOW, FAST))
    split = sum(d is not None for d in p.tp_dims().values())
    text = str(p)
    assert "data split over: dp (2); global batch 4096 rows, 2048 per data-parallel rank" in text
    assert f"axis 1 tp (4): tensor parallel: {split} of 8 parameters split, the group computes the same rows" in text


def test_global_batch_widens_the_batch_dimension_only():
    ids, mask, scale = torch.zeros(3, 5, dtype=torch.long), torch.ones(3, 5, dtype=torch.bool), torch.ones(7)
    wide = global_batch((ids, {"mask": mask, "scale": scale, "n": 2}), 4)
    assert (wide[0].shape, wide[0].dtype) == ((12, 5), torch.long)
    assert (wide[1]["mask"].shape, wide[1]["mask"].dtype) == ((12, 5), torch.bool)
    assert wide[1]["scale"] is scale and wide[1]["n"] == 2


@pytest.fixture
def world_of_8():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_auto_plans_each_rank_slice_times_the_world(world_of_8, monkeypatch):
    import dpar.planning

    planned = []
    real = dpar.planning.plan
    monkeypatch.setattr(dpar.planning, "plan", lambda *a, **k: planned.append(real(*a, **k)) or planned[-1])
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    dpar.parallelize(model, strategy="auto", example_inputs=(torch.randn(1 << 13, 16),))
    [chosen] = planned
    assert (chosen.batch_size, chosen.mesh_shape) == (8 << 13, (8,))
    assert chosen.strategy in DATA_PARALLEL


def test_mesh_of_a_plan_groups_the_tp_axis_and_folds_the_dp_axes(world_of_8):
    from dpar.placement import _mesh_of_plan

    model, inputs = mlp(hidden=4096, batch=64)
    p = plan(model, inputs, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"), device=hardware(SLOW, FAST))
    three_d = dataclasses.replace(p, mesh_shape=(2, 2, 2), mesh_dim_names=("dp", "tp", "dp"))
    mesh = _mesh_of_plan(nn.Linear(1, 1), three_d)
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert mesh.mesh.tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # rank = 4·dp0 + 2·tp + dp2


# Numerics: 2 gloo ranks, each fed its own slice, against torch DDP on the same slices.


def train_both(rank: int, world_size: int, case: Case, rows: int, hand_plan: Plan | None) -> tuple[dict, dict, str]:
    """(torch DDP's state, dpar's state, the plan's strategy as run) after STEPS on this rank's slices.

    dpar runs ``strategy="auto"`` from this rank's first slice, or ``plan=hand_plan``.
    """
    states = []
    for reference in (True, False):
        model = seeded_model(case)
        x0, y0 = (t.chunk(world_size)[rank] for t in batch_of(case.model, 0, 0, rows * world_size))
        example = (x0, y0) if case.model == "gpt" else (x0,)
        if reference:
            runner = nn.parallel.DistributedDataParallel(model)
        else:
            chosen = hand_plan or plan(model, global_batch(example, world_size), mesh_shape=(world_size,))
            if hand_plan is None:
                dpar.parallelize(model, strategy="auto", example_inputs=example)
            else:
                dpar.parallelize(model, plan=hand_plan)
            runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        opt = make_optimizer(case.optimizer, model.parameters())
        for step in range(STEPS):
            opt.zero_grad()
            x, y = (t.chunk(world_size)[rank] for t in batch_of(case.model, step, 0, rows * world_size))
            loss_of(case.model, runner, x, y).backward()
            opt.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()} if reference else dpar.checkpoint.full_state_dict(model))
    return states[0], states[1], chosen.as_run().strategy


@pytest.mark.parametrize("model,optimizer", [("gpt", "adamw"), ("mlp", "sgd")])
def test_auto_on_per_rank_slices_matches_torch_ddp(model: str, optimizer: str) -> None:
    case = Case(model, optimizer)
    ddp, parallel, strategy = run_ranks(train_both, 2, case, ROWS_PER_RANK[model], None, timeout_s=420)[0]
    assert max_abs_diff(ddp, seeded_model(case).state_dict()) > 1e-4  # it trained
    diff = max_abs_diff(parallel, ddp)
    print(f"auto ({strategy}), {case.id}, {ROWS_PER_RANK[model]} rows per rank: max |difference| from torch DDP {diff:.2e}")
    assert strategy in DATA_PARALLEL
    assert diff <= TOLERANCE[optimizer]


def _hand_built(mesh_shape: tuple[int, ...], axis: int, strategy: str, data_parallel: str) -> Plan:
    """A plan for the tiny GPT on ``mesh_shape`` whose axis ``axis`` is named tp but splits nothing."""
    x, y = batch_of("gpt", 0, 0, 8)
    names = ("dp",) * len(mesh_shape)
    p = plan(seeded_model(Case("gpt", "sgd")), (x, y), mesh_shape=mesh_shape, mesh_dim_names=names)
    return dataclasses.replace(_unsplit_tp(p, axis, strategy), data_parallel=data_parallel)


@pytest.mark.parametrize(
    "mesh_shape,axis,strategy,data_parallel,runs_as",
    [((2,), 0, "tp", "replicate", "ddp"), ((1, 2), 1, "zero2+tp", "zero2", "zero2")],
)
def test_hand_built_plan_whose_tp_axis_splits_nothing_trains_like_torch_ddp(
    mesh_shape, axis, strategy, data_parallel, runs_as
) -> None:
    hand = _hand_built(mesh_shape, axis, strategy, data_parallel)
    ddp, parallel, ran = run_ranks(train_both, 2, Case("gpt", "sgd"), 4, hand, timeout_s=420)[0]
    diff = max_abs_diff(parallel, ddp)
    print(f"hand-built {strategy} on {mesh_shape}, tp splitting nothing, ran as {ran}: max |difference| {diff:.2e}")
    assert ran == runs_as
    assert diff <= TOLERANCE["sgd"]
