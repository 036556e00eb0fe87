"""parallelize refuses what it cannot do, naming the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dpar
from models import MLP


def test_unknown_strategy_suggests_the_closest(world_of_four) -> None:
    with pytest.raises(ValueError, match=r"unknown strategy 'fdsp' \(did you mean 'fsdp'\?\); choose one of \['ddp', 'zero1', 'zero2', 'fsdp', 'hsdp', 'tp', 'ddp\+tp', 'zero2\+tp', 'fsdp\+tp', 'local_sgd', 'ep', 'ddp\+ep', 'zero2\+ep', 'fsdp\+ep', 'cp', 'ddp\+cp', 'zero2\+cp', 'fsdp\+cp', 'cp\+tp', 'ddp\+cp\+tp', 'zero2\+cp\+tp', 'fsdp\+cp\+tp', 'auto'\]"):
        dpar.parallelize(MLP(), strategy="fdsp")


def test_mesh_that_does_not_cover_the_world(world_of_four) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match=r"needs a 1-D mesh over the whole world \(4 ranks\), got mesh shape \(2, 2\)"):
        dpar.parallelize(MLP(), strategy="fsdp", mesh=mesh)


def test_hsdp_needs_a_two_dimensional_mesh(world_of_four) -> None:
    with pytest.raises(ValueError, match=r"'hsdp' needs a 2-D mesh \(replicate, shard\).*got None.*mesh_dim_names"):
        dpar.parallelize(MLP(), strategy="hsdp")


def test_parallelize_twice(world_of_four) -> None:
    model = MLP()
    dpar.parallelize(model, strategy="fsdp")
    with pytest.raises(ValueError, match="parallelize was already called on this model"):
        dpar.parallelize(model, strategy="zero2")


def test_optimizer_built_before_parallelize_fails_at_its_first_step(world_of_four) -> None:
    model = MLP()
    early = torch.optim.AdamW(model.parameters())
    dpar.parallelize(model, strategy="fsdp")
    with pytest.raises(ValueError, match="built before dpar.parallelize.*build the optimizer after parallelize"):
        early.step()
    torch.optim.AdamW(model.parameters()).step()  # one built afterwards steps on the shards


def test_sharding_needs_a_process_group() -> None:
    with pytest.raises(dpar.ProcessGroupError, match="call torch.distributed.init_process_group"):
        dpar.parallelize(MLP(), strategy="zero2")


def test_scalar_parameters_cannot_be_sharded(world_of_four) -> None:
    model = nn.Module()
    model.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="parameter scale is a scalar"):
        dpar.parallelize(model, strategy="fsdp")


@pytest.mark.parametrize("bad", [0, -2, "two"])
def test_in_flight_limit_must_be_a_positive_integer(world_of_four, bad) -> None:
    with pytest.raises(ValueError, match="max_inflight_gathers must be an integer >= 1"):
        dpar.parallelize(MLP(), strategy="fsdp", max_inflight_gathers=bad)


@pytest.mark.parametrize(
    "strategy,place",
    [
        ("ddp", r"under 'ddp' gradient buckets are sized when compiling.*options=\{'bucket_cap_mb': 5\}"),
        ("tp", r"strategy 'tp' has no gradient buckets"),
        ("auto", r"strategy='auto' chooses the strategy.*parallelize\(model, plan=plan, bucket_cap_mb=\.\.\.\)"),
    ],
)
def test_bucket_cap_given_to_parallelize_where_it_does_not_apply_names_where_it_does(world_of_four, strategy, place) -> None:
    with pytest.raises(ValueError, match=place):
        dpar.parallelize(MLP(), strategy=strategy, bucket_cap_mb=5, example_inputs=(torch.randn(2, 16),))


def test_bucket_cap_as_a_compile_option_on_sharded_parameters_names_parallelize(world_of_four) -> None:
    model = dpar.parallelize(MLP(), strategy="fsdp")
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager", "bucket_cap_mb": 1})
    with pytest.raises(ValueError, match=r"these parameters are sharded.*dpar.parallelize\(model, strategy=\.\.\., bucket_cap_mb=\.\.\.\)"):
        compiled(torch.randn(2, 16))
