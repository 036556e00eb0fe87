"""The pipeline: for each plan, the passes it lists are the passes that run, stage by stage, in order.

Four simulated ranks; 2-D strategies on a (2, 2) mesh. The listing is read off
``PassListing.listing()`` for the plan ``parallelize`` left on the model, and the
passes that ran off the graphs the backend recorded. ``dpar.pipeline``'s rows
(``PipelinePassListing``) are held to the graphs its step runs, on a ("dp", "pp") mesh.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dpar
from dpar.compiler.options import Options
from dpar.compiler.pass_listing import PassListing, PipelinePassListing
from dpar.compiler.registry import STAGES_KEY
from dpar.core.plan import AxisRole, DataParallel, ParallelPlan, Strategy, replicated
from dpar.placement import plan_of
from dpar.core.errors import OptionsError
from dpar.core.world import current_world
from fake_world import fake_world
from pipeline_models import mse, stack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

WAITS = ["sink_waits"]
GATHERS = ["bucket_all_gathers"]
SHARDED_FORWARD = ["broadcast_buffers", *GATHERS, *WAITS, "prefetch_all_gathers"]
SHARDED_BACKWARD = [*GATHERS, "bucket_reduce_scatters", *WAITS, "prefetch_all_gathers"]
TP_JOINT = ["unroll_group_batch", "tensor_parallel"]
KEEP_IN_FORWARD = ["keep_collectives_in_forward"]  # last in a training joint graph with a tensor axis

COPIES_BACKWARD = "recompute_when_needed"  # a tp group's copies of each rank's rows read their tangents first
# What a newcomer should be able to read off pass_listing.py: stage -> passes, per strategy.
EXPECTED = {
    "ddp": {"dynamo": [], "joint": [], "forward": ["broadcast_buffers", *WAITS],
            "backward (sync)": ["all_reduce_gradients", *WAITS], "backward (no_sync)": []},
    "fsdp": {"dynamo": [], "joint": ["tag_gathers", "save_random_ops"], "forward": SHARDED_FORWARD,
             "backward (sync)": SHARDED_BACKWARD},
    "tp": {"dynamo": ["mark_own_rows"], "joint": [*TP_JOINT, *KEEP_IN_FORWARD], "forward": ["broadcast_buffers", *WAITS],
           "backward (sync)": [COPIES_BACKWARD, *WAITS], "inference": [*TP_JOINT, "broadcast_buffers", *WAITS]},
    "ddp+tp": {"dynamo": ["mark_own_rows"], "joint": [*TP_JOINT, *KEEP_IN_FORWARD], "forward": ["broadcast_buffers", *WAITS],
               "backward (sync)": [COPIES_BACKWARD, "all_reduce_gradients", *WAITS]},
    "local_sgd": {"dynamo": [], "joint": [], "forward": ["broadcast_buffers", *WAITS],
                  "forward (average)": ["average_parameters", "broadcast_buffers", *WAITS], "backward (sync)": WAITS},
    "zero1": {"dynamo": [], "joint": [], "forward": ["broadcast_buffers", *WAITS],
              "backward (sync)": ["all_reduce_gradients", *WAITS], "backward (no_sync)": []},
    "fsdp+tp": {"dynamo": ["mark_own_rows"], "joint": [*TP_JOINT, "tag_gathers", "save_random_ops", *KEEP_IN_FORWARD],
                "forward": SHARDED_FORWARD, "backward (sync)": [COPIES_BACKWARD, *SHARDED_BACKWARD],
                "inference": [*TP_JOINT, *SHARDED_FORWARD]},
}


def gpt_and_batch() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64, fused_qkv=False)
    return GPT(config), torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))


def parallelized(strategy: str, x: torch.Tensor, model: torch.nn.Module) -> torch.nn.Module:
    kwargs: dict = {"example_inputs": (x,)} if "tp" in strategy else {}
    if strategy == "local_sgd":
        kwargs["sync_every"] = 1
    if "+" in strategy:
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return dpar.parallelize(model, strategy=strategy, **kwargs)


@pytest.mark.parametrize("strategy", sorted(EXPECTED))
def test_the_listed_passes_are_the_ones_that_run(strategy: str) -> None:
    model, x, y = gpt_and_batch()
    with fake_world(4) as graphs:
        parallelized(strategy, x, model)
        world = current_world()
        plan = plan_of(model) or replicated(world.group_name, world.size)
        listing = PassListing(plan, [], world, Options()).listing()
        # A no_grad forward reads local buffers (as DDP's evaluation does): nothing to broadcast.
        evaluation = PassListing(plan, [], world, Options(broadcast_buffers=False)).listing()["inference"]
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        compiled(x, y).backward()
        with torch.no_grad():
            compiled(x)
    for stage, passes in EXPECTED[strategy].items():
        assert listing[stage] == passes, stage
    ran = {g.label.removesuffix(" graph").replace("graph ", ""): [s.pass_name for s in g.stages[1:]] for g in graphs}
    if "backward" in ran:  # only ddp compiles a backward per variant
        ran["backward (sync)"] = ran.pop("backward")
    assert ran["inference"] == evaluation
    for stage in ("joint", "forward", "backward (sync)"):
        if listing[stage] or stage in ran:
            assert ran.get(stage, []) == listing[stage], stage


# dpar.pipeline over dp: the stage's graphs run as traced; the variants carry the data-parallel passes.
PIPELINE_EXPECTED = {
    ("ddp", "1f1b"): {"B (sync)": ["all_reduce_gradients", "sink_waits"]},
    ("ddp", "zb_h1"): {"W (sync)": ["all_reduce_gradients", "sink_waits"]},
    ("fsdp", "1f1b"): {"F (gather)": ["gather_parameters"], "B (sync)": ["reduce_scatter_gradients", "sink_waits"]},
    ("fsdp", "zb_h1"): {"F (gather)": ["gather_parameters"], "W (sync)": ["reduce_scatter_gradients", "sink_waits"]},
}


def _ran(gm: torch.fx.GraphModule) -> list[str]:
    return [s.pass_name for s in gm.meta.get(STAGES_KEY, ())[1:]]


def test_the_listed_pipeline_passes_are_the_ones_its_step_runs() -> None:
    """Each variant's passes as listed, built from the graph the listing names (its code before the passes) and
    run by the executor at the action the listing names (the stage's first F; its last B, or W under zb_h1)."""
    for (dp_strategy, schedule), variants in PIPELINE_EXPECTED.items():
        with fake_world(4):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
            model, (x, y) = stack(rows=4)
            step = dpar.pipeline(model, mse, example_inputs=(x, y), stages=2, micro_batches=8, schedule=schedule,
                                 mesh=mesh, dp_strategy=dp_strategy)
        listing = PipelinePassListing(DataParallel(dp_strategy), 2, schedule).listing()
        assert listing == {"F": [], "B": [], "I": [], "W": [], **variants}, (dp_strategy, schedule)
        executor = step.executor
        for s, g in step.graphs.items():
            kinds = PipelinePassListing.GRAPHS
            ran = {letter: _ran(getattr(g, kind)) for letter, kind in kinds.items()}
            built = {}
            if s in executor.gather:
                ran["F (gather)"] = _ran(executor.gather[s])
                built["F (gather)"] = (executor.gather[s], executor.first_forward[s].op)
            if s in executor.sync:
                action = executor.last_backward[s]
                ran[f"{action.op.value} (sync)"] = _ran(executor.sync[s].graph)
                built[f"{action.op.value} (sync)"] = (executor.sync[s].graph, action.op)
            assert ran == listing, (dp_strategy, schedule, s)
            for row, (gm, op) in built.items():
                assert row.startswith(op.value)
                assert gm.meta[STAGES_KEY][0].code == getattr(g, kinds[op.value]).code, row
    with fake_world(2):  # one pipeline: nothing to average, no variant
        model, (x, y) = stack(rows=4)
        step = dpar.pipeline(model, mse, example_inputs=(x, y), stages=2, micro_batches=8, dp_strategy="fsdp")
    assert PipelinePassListing(DataParallel.FSDP, 1, "1f1b").listing() == {"F": [], "B": [], "I": [], "W": []}
    assert not step.executor.sync and not step.executor.gather


def test_the_plan_is_one_frozen_value_with_an_axis_per_mesh_dimension() -> None:
    model, x, _ = gpt_and_batch()
    with fake_world(4):
        parallelized("fsdp+tp", x, model)
        plan = plan_of(model)
        assert plan.strategy is Strategy.FSDP_TP and plan.strategy.reshard_after_forward
        assert [(a.name, a.role, a.size) for a in plan.axes] == [("dp", AxisRole.SHARD, 2), ("tp", AxisRole.TENSOR, 2)]
        assert plan.bucket_of("blocks.1.mlp.up.weight") == "blocks.1"
        with pytest.raises(AttributeError):
            plan.max_inflight_gathers = 3  # type: ignore[misc]


def test_a_graph_mixing_parameters_of_two_plans_is_refused() -> None:
    """A parameter no plan covers would get no gradient synchronisation: the backend says so."""
    model, x, y = gpt_and_batch()
    stranger = torch.nn.Linear(64, 64)
    with fake_world(4):
        parallelized("fsdp", x, model)
        compiled = torch.compile(lambda a, b: model(a, b) + stranger.weight.sum(), backend="dpar",
                                 options={"compiler": "aot_eager"})
        with pytest.raises(OptionsError, match="belongs to no model dpar.parallelize was called on"):
            compiled(x, y)


def test_strategy_names_parse_with_a_suggestion() -> None:
    assert Strategy.parse("zero2+tp") is Strategy.ZERO2_TP
    with pytest.raises(OptionsError, match="did you mean 'fsdp'"):
        Strategy.parse("fsdpp")
    assert isinstance(replicated("0", 2), ParallelPlan)
