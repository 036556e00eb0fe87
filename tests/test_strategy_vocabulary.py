"""The one strategy vocabulary (core/plan.py): every other spelling of a strategy is derived from it.

The sets below are the ones the api, the backend, the planner and the inspector spelled out by
hand before they were derived; a change to the vocabulary that moves one of them fails here by name.
"""

from __future__ import annotations

import pytest
import torch

import dpar
from dpar.core.errors import InspectionError, OptionsError
from dpar.core.plan import AxisRole, DataParallel, Strategy, check_bucket_cap
from dpar.inspect.explain import explain as explain_below_the_api
from dpar.inspect.strategies import STRATEGIES as INSPECTED
from dpar.placement import ACCEPTS, STRATEGIES, TENSOR_PARALLEL
from dpar.planner.layout import layouts
from dpar.planner.strategies import STRATEGIES as PRICED

S = Strategy


def named(predicate) -> set[str]:
    return {s.value for s in Strategy if predicate(s)}


def test_derived_sets_are_the_ones_spelled_by_hand_before() -> None:
    assert STRATEGIES == ("ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "ddp+tp", "zero2+tp", "fsdp+tp", "local_sgd", "ep", "ddp+ep", "zero2+ep", "fsdp+ep", "cp", "ddp+cp", "zero2+cp", "fsdp+cp", "cp+tp", "ddp+cp+tp", "zero2+cp+tp", "fsdp+cp+tp", "auto")
    assert TENSOR_PARALLEL == ("tp", "ddp+tp", "zero2+tp", "fsdp+tp")
    assert named(lambda s: s.all_reduces_gradients) == {"ddp", "ddp+tp", "zero1", "ep", "ddp+ep", "ddp+cp", "ddp+cp+tp"}
    assert named(lambda s: s.expert_parallel) == {"ep", "ddp+ep", "zero2+ep", "fsdp+ep"}
    assert named(lambda s: s.context_parallel) == {"cp", "ddp+cp", "zero2+cp", "fsdp+cp", "cp+tp", "ddp+cp+tp",
                                                   "zero2+cp+tp", "fsdp+cp+tp"}
    assert named(lambda s: s.tensor_parallel) == {*TENSOR_PARALLEL, "cp+tp", "ddp+cp+tp", "zero2+cp+tp", "fsdp+cp+tp"}
    assert named(lambda s: s.identical_gradients) == {"ddp", "zero1", "ddp+cp"}
    assert named(lambda s: s.shards_parameters) == {"zero2", "fsdp", "hsdp", "zero2+tp", "fsdp+tp", "zero2+ep", "fsdp+ep",
                                                    "zero2+cp", "fsdp+cp", "zero2+cp+tp", "fsdp+cp+tp"}
    assert named(lambda s: s.reshard_after_forward) == {"fsdp", "hsdp", "fsdp+tp", "fsdp+ep", "fsdp+cp", "fsdp+cp+tp"}
    assert named(lambda s: s.buckets_laid_out_by is None) == {"tp", "local_sgd", "cp", "cp+tp"}
    assert PRICED == ("ddp", "zero2", "fsdp", "tp", "ddp+tp", "zero2+tp", "fsdp+tp", "ep", "ddp+ep", "zero2+ep", "fsdp+ep",
                      "cp", "ddp+cp", "zero2+cp", "fsdp+cp")
    assert S.HSDP.roles == (AxisRole.REPLICATE, AxisRole.SHARD) and S.HSDP.mesh_dim_names == ("replicate", "shard")
    assert S.FSDP_TP.mesh_dim_names == ("dp", "tp") and S.FSDP.mesh_dim_names == ("shard",)
    assert S.EP.roles == (AxisRole.EXPERT,) and S.EP.mesh_dim_names == ("ep",) and S.DDP_EP.mesh_dim_names == ("dp", "ep")
    assert S.FSDP_EP.roles == (AxisRole.SHARD, AxisRole.EXPERT) and S.FSDP_EP.mesh_dim_names == ("dp", "ep")
    assert S.CP.mesh_dim_names == ("cp",) and S.FSDP_CP.roles == (AxisRole.SHARD, AxisRole.CONTEXT)
    assert S.FSDP_CP.mesh_dim_names == ("dp", "cp")
    assert S.CP_TP.mesh_dim_names == ("cp", "tp") and S.FSDP_CP_TP.mesh_dim_names == ("dp", "cp", "tp")
    assert S.FSDP_CP_TP.roles == (AxisRole.SHARD, AxisRole.CONTEXT, AxisRole.TENSOR)
    table = {name: (s.strategy, s.local_state, s.shards_parameters, s.takes_bucket_cap, s.reduces_gradients)
             for name, s in INSPECTED.items()}
    assert table == {
        "ddp": (S.DDP, False, False, False, True), "zero2": (S.ZERO2, False, True, True, True),
        "fsdp": (S.FSDP, False, True, True, True), "hsdp": (S.HSDP, True, False, True, True),
        "tp": (S.TP, True, False, False, False), "tp+sp": (S.TP, True, False, False, False),
        "ddp+tp": (S.DDP_TP, True, False, False, True), "zero2+tp": (S.ZERO2_TP, True, False, True, True),
        "fsdp+tp": (S.FSDP_TP, True, False, True, True), "auto": (None, True, False, False, False),
        "ep": (S.EP, True, False, False, True), "ddp+ep": (S.DDP_EP, True, False, False, True),
        "zero2+ep": (S.ZERO2_EP, True, False, True, True), "fsdp+ep": (S.FSDP_EP, True, False, True, True),
        "cp": (S.CP, False, False, False, True), "ddp+cp": (S.DDP_CP, True, False, False, True),
        "zero2+cp": (S.ZERO2_CP, True, False, True, True), "fsdp+cp": (S.FSDP_CP, True, False, True, True),
        "cp+tp": (S.CP_TP, True, False, False, True), "ddp+cp+tp": (S.DDP_CP_TP, True, False, False, True),
        "zero2+cp+tp": (S.ZERO2_CP_TP, True, False, True, True), "fsdp+cp+tp": (S.FSDP_CP_TP, True, False, True, True),
    }


def test_compose_inverts_mode_and_tensor_axis() -> None:
    for s in Strategy:
        if sum(r is not AxisRole.TENSOR for r in s.roles) <= 1 and not s.expert_parallel and not s.context_parallel:  # hsdp: 2 data axes
            assert Strategy.compose(s.data_parallel, s.tensor_parallel) is s
    assert {layout.strategy for layout in layouts((2, 2), None)} == {"ddp", "zero2", "fsdp", "ddp+tp", "zero2+tp", "fsdp+tp"}
    assert {layout.strategy for layout in layouts((4,), ("tp",))} == {"tp"}


def test_unknown_names_are_refused_alike() -> None:
    with pytest.raises(OptionsError, match=r"unknown strategy 'fdsp' \(did you mean 'fsdp'\?\); choose one of \['ddp', 'zero1'"):
        Strategy.parse("fdsp")
    with pytest.raises(OptionsError, match=r"pipeline: unknown dp_strategy 'fdsp' \(did you mean 'fsdp'\?\); choose one of \['ddp', 'fsdp'\]"):
        DataParallel.parse("fdsp", (DataParallel.DDP, DataParallel.FSDP), prefix="pipeline: ")


@pytest.mark.parametrize(
    "strategy, given_to, message",
    [
        (S.DDP, "parallelize", r"under 'ddp' gradient buckets are sized when compiling"),
        (S.ZERO1, "parallelize", r"under 'zero1' gradient buckets are sized when compiling"),
        (S.TP, "parallelize", r"strategy 'tp' has no gradient buckets"),
        (S.LOCAL_SGD, "parallelize", r"strategy 'local_sgd' has no gradient buckets"),
        (None, "parallelize", r"strategy='auto' chooses the strategy"),
        (S.FSDP, "compile", r"these parameters are sharded, and their buckets are laid out by parallelize"),
        (S.LOCAL_SGD, "compile", r"averaged by local SGD"),
        (S.TP, "compile", r"split by strategy 'tp', which has no gradient buckets"),
    ],
)
def test_the_bucket_knob_is_policed_in_one_place(strategy, given_to, message) -> None:
    with pytest.raises(OptionsError, match=message):
        check_bucket_cap(strategy, given_to, 5)
    check_bucket_cap(strategy, given_to, None)


def test_the_bucket_knob_is_taken_where_the_strategy_lays_out_its_buckets() -> None:
    for s in Strategy:
        if s.buckets_laid_out_by is not None:
            check_bucket_cap(s, s.buckets_laid_out_by, 5)


def test_validation_table_names_the_strategies_taking_each_option() -> None:
    assert ACCEPTS["sequence_parallel"][0] == set(TENSOR_PARALLEL)  # not beside a cp axis, which splits the sequence
    assert ACCEPTS["same_batch_in_tp_group"][0] == set(TENSOR_PARALLEL) | {"cp+tp", "ddp+cp+tp", "zero2+cp+tp", "fsdp+cp+tp"}
    assert ACCEPTS["sync_every"][0] == {"local_sgd"} == ACCEPTS["outer_optimizer"][0]
    assert ACCEPTS["param_dtype"][0] == {"zero2", "fsdp", "hsdp", "auto"} == ACCEPTS["reduce_dtype"][0]
    with pytest.raises(OptionsError, match=r"param_dtype applies to the sharded strategies without a tensor, expert or context axis \(fsdp, hsdp, zero2\).*for 'zero1' use torch.autocast"):
        dpar.parallelize(torch.nn.Linear(4, 4), strategy="zero1", param_dtype=torch.bfloat16)


def test_inspection_places_a_model_only_with_the_parallelize_the_api_hands_down() -> None:
    with pytest.raises(InspectionError, match=r"strategy 'fsdp' places the model with dpar.parallelize.*call dpar.explain"):
        explain_below_the_api(torch.nn.Linear(4, 4), (torch.randn(2, 4),), world_size=2, strategy="fsdp")
