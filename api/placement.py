"""``dpar.parallelize``: choose how parameters are placed before the model is compiled."""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dpar.compiler.megatron import megatron_dims
from dpar.compiler.optimizer_step import OPTIMIZER_STAGE
from dpar.core.plan import AxisRole, MeshAxis, ParallelPlan, Strategy, attach, plan_of_model
from dpar.core import model_state
from dpar.runtime import optimizer_hooks
from dpar.surgery import local_sgd, sharding, tensor_parallel, zero1
from dpar.core.errors import OptionsError, ProcessGroupError

if TYPE_CHECKING:
    from dpar.planner.plan import Plan

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "ddp+tp", "zero2+tp", "fsdp+tp", "local_sgd", "auto")
TENSOR_PARALLEL = ("tp", "ddp+tp", "zero2+tp", "fsdp+tp")


def _sharded_buckets(model: nn.Module, bucket_cap_mb: float | None) -> dict[str, str]:
    """Parameter name -> the bucket whose all-gather and reduce-scatter it shares: per numbered
    block (``layers.3``) when ``bucket_cap_mb`` is None, else consecutive parameters up to the cap."""
    if bucket_cap_mb is None:
        return {n: sharding.block_of(n) for n, _ in model.named_parameters()}
    cap_bytes = int(bucket_cap_mb * 1024 * 1024)
    bucket_of, index, filled = {}, 0, 0
    for name, p in model.named_parameters():
        bucket_of[name] = f"bucket{index}"
        filled += p.numel() * p.element_size()
        if filled >= cap_bytes:
            index, filled = index + 1, 0
    return bucket_of


def _check_bucket_cap(strategy: str, bucket_cap_mb: float | None) -> None:
    """One knob, in the one place it applies for ``strategy``."""
    if bucket_cap_mb is None:
        return
    if not (isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool) and bucket_cap_mb > 0):
        raise OptionsError(f"bucket_cap_mb must be None (per block) or a number > 0, got {bucket_cap_mb!r}")
    if strategy == "local_sgd":
        raise OptionsError(
            "strategy 'local_sgd' has no gradient buckets (it averages the parameters every sync_every steps, "
            "one flattened all-reduce per dtype): leave bucket_cap_mb unset"
        )
    if strategy in ("ddp", "zero1", "ddp+tp"):
        raise OptionsError(
            f"under {strategy!r} gradient buckets are sized when compiling, in the order gradients become "
            f"ready: pass torch.compile(model, backend='dpar', options={{'bucket_cap_mb': {bucket_cap_mb}}}) "
            "instead of parallelize(..., bucket_cap_mb=...)"
        )
    if strategy == "auto":
        raise OptionsError(
            "strategy='auto' chooses the strategy, so where buckets are sized is not known yet: plan first, "
            "plan = dpar.plan(...), then parallelize(model, plan=plan, bucket_cap_mb=...) for a sharded plan"
        )
    if strategy == "tp":
        raise OptionsError(
            "strategy 'tp' has no gradient buckets (its collectives carry activations, each where the graph "
            "needs it): leave bucket_cap_mb unset"
        )


def parallelize(
    model: nn.Module,
    *,
    strategy: str = "fsdp",
    mesh: DeviceMesh | None = None,
    bucket_cap_mb: float | None = None,
    max_inflight_gathers: int | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    tp_plan: dict[str, int | None] | None = None,
    example_inputs: Sequence[Any] | None = None,
    plan: Plan | None = None,
    memory_budget_gb: float | None = None,
    sequence_parallel: bool = False,
    same_batch_in_tp_group: bool = False,
    sync_every: int | None = None,
    outer_optimizer: local_sgd.OuterSGD | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters in place for ``strategy``; build the optimizer afterwards.

    ``tp`` splits layers over a 1-D ``mesh`` (Megatron: column- then row-parallel
    Linears, heads split, a tied embedding split by vocabulary); ``ddp+tp`` and
    ``zero2+tp``/``fsdp+tp`` take a 2-D mesh whose dimensions are named
    ``("dp", "tp")``. ``sequence_parallel=True`` (Megatron-SP) splits the token
    stream between the tensor-parallel layers along the sequence: each block's
    all-reduce becomes a reduce-scatter there and an all-gather before the
    next column-parallel layer, so norms and residuals hold 1/tp of the tokens.
    Every strategy takes DDP's data contract: each rank is fed its own slice of
    the global batch, and tensor parallel moves the rows a group needs itself;
    ``same_batch_in_tp_group=True`` says the user already feeds every rank of a
    tensor-parallel group the same rows (Megatron's habit), which the first steps
    check. Which dimension of each
    parameter tensor parallel splits comes from ``tp_plan`` (name -> dim, None
    for replicated) or, without it, from the forward run once on
    ``example_inputs``. ``plan`` (from ``dpar.plan``) gives strategy, mesh and
    splits; ``strategy="auto"`` plans first, from ``example_inputs`` and
    ``memory_budget_gb``.

    ``hsdp`` shards over the second dimension of a 2-D ``mesh`` and replicates
    over the first. ``bucket_cap_mb=None`` groups parameters per numbered block
    (``layers.3``), the rest in one ``root`` bucket; a number groups consecutive
    parameters up to that many MiB instead (under ddp the same knob is a compile
    option, and is refused here). ``max_inflight_gathers`` bounds how many
    all-gathers may be issued ahead of their use (the memory prefetch costs); None
    chooses it from the cost model (compiler/passes/prefetch.py), 1 where communication
    cannot overlap compute. ``param_dtype`` (e.g.
    ``torch.bfloat16``) is the dtype parameters are gathered and computed in, and
    ``reduce_dtype`` the one gradients are reduce-scattered in; shards, their
    gradients and the optimizer state stay in the stored dtype (float32).
    """
    if plan is not None:  # a "tp" axis that splits no parameter runs as data parallel: see Plan.as_run
        plan = plan.as_run()
        strategy, tp_plan = plan.strategy, plan.tp_dims()
    if strategy not in STRATEGIES:
        close = difflib.get_close_matches(str(strategy), STRATEGIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise OptionsError(f"unknown strategy {strategy!r}{hint}; choose one of {list(STRATEGIES)}")
    if plan_of_model(model) is not None or sharding.is_sharded(model):
        raise OptionsError(
            "parallelize was already called on this model; build a fresh model to choose another strategy"
        )
    if max_inflight_gathers is not None and (
        isinstance(max_inflight_gathers, bool) or not isinstance(max_inflight_gathers, int) or max_inflight_gathers < 1
    ):
        raise OptionsError(
            f"max_inflight_gathers must be an integer >= 1, or None to choose it from cost, got {max_inflight_gathers!r}"
        )
    _check_bucket_cap(strategy, bucket_cap_mb)
    _check_sync_every(strategy, sync_every)
    model_state.record_meta_buffers(model)  # see [Note: buffers of a model born on meta]
    if outer_optimizer is not None and (strategy != "local_sgd" or not isinstance(outer_optimizer, local_sgd.OuterSGD)):
        raise OptionsError(
            f"outer_optimizer is local SGD's outer step (DiLoCo): pass strategy='local_sgd', sync_every=H, "
            f"outer_optimizer=dpar.OuterSGD(lr=0.7, momentum=0.9); got strategy {strategy!r}, {outer_optimizer!r}"
        )
    for knob, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise OptionsError(f"{knob} must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")
    if same_batch_in_tp_group and strategy not in TENSOR_PARALLEL:
        raise OptionsError(
            f"same_batch_in_tp_group says every rank of a tensor-parallel group is fed the same rows; strategy "
            f"{strategy!r} has no such group: feed every rank its own slice, as with DDP"
        )
    if sequence_parallel and strategy not in TENSOR_PARALLEL:
        raise OptionsError(
            f"sequence_parallel splits the activations between tensor-parallel layers; it needs a "
            f"tensor-parallel strategy ({', '.join(TENSOR_PARALLEL)}), not {strategy!r}"
        )
    if strategy == "ddp":
        if param_dtype is not None or reduce_dtype is not None:
            raise OptionsError("param_dtype/reduce_dtype apply to zero2 and fsdp; for ddp use torch.autocast")
        # Replication needs no change at rest (the backend inserts the all-reduces); the state lets the backend
        # find the parameters by name through swap_tensors and load_state_dict(assign=True).
        model_state.state_of(model, create=True)
        return model
    if not dist.is_initialized():
        raise ProcessGroupError(
            f"strategy {strategy!r} places parameters over ranks, but torch.distributed is not "
            "initialized: call torch.distributed.init_process_group() before dpar.parallelize"
        )
    world = dist.get_world_size()
    device_type = _mesh_device_type(model)
    if plan is not None and mesh is None:
        mesh = _mesh_of_plan(model, plan)
    if strategy == "auto":
        return _parallelize_auto(model, mesh, example_inputs, memory_budget_gb, world, param_dtype, reduce_dtype)
    if strategy in ("zero1", "local_sgd"):
        placed = _parallelize_replicated(
            model, Strategy(strategy), mesh, param_dtype, reduce_dtype, world, device_type, sync_every
        )
        if strategy == "zero1":  # each rank's optimizer steps and keeps state for its range of each parameter
            zero1.shard_optimizer_state(model.parameters(), placed.get_group())
            # The optimizer stage that steps them, from the first step on (dpar.checkpoint.load steps before compiling).
            optimizer_hooks.hand_down(OPTIMIZER_STAGE, model.parameters())
        else:  # where the model is in its averaging period, read by the backend and saved with checkpoints
            local_sgd.attach(local_sgd.Period(sync_every, outer_optimizer), model)
        return model
    if strategy in TENSOR_PARALLEL:
        if param_dtype is not None or reduce_dtype is not None:
            raise OptionsError(f"param_dtype/reduce_dtype are not supported with {strategy!r} yet; use torch.autocast")
        _parallelize_tensor_parallel(
            model, strategy, mesh, tp_plan, example_inputs, world, device_type, max_inflight_gathers,
            sequence_parallel, same_batch_in_tp_group, bucket_cap_mb,
        )
        optimizer_hooks.watch_optimizers()
        return model
    if strategy == "hsdp":
        if mesh is None or mesh.ndim != 2 or mesh.size() != world:
            shape = tuple(mesh.shape) if mesh is not None else None
            raise OptionsError(
                f"strategy 'hsdp' needs a 2-D mesh (replicate, shard) over the whole world ({world} "
                f"ranks), got {shape}; e.g. init_device_mesh({device_type!r}, (2, {max(world // 2, 1)}), "
                "mesh_dim_names=('replicate', 'shard'))"
            )
    else:
        mesh = mesh if mesh is not None else init_device_mesh(device_type, (world,))
        if mesh.ndim != 1 or mesh.size() != world:
            raise OptionsError(
                f"strategy {strategy!r} needs a 1-D mesh over the whole world ({world} ranks), got "
                f"mesh shape {tuple(mesh.shape)}; pass init_device_mesh(device, ({world},)) or omit "
                "mesh (for a 2-D mesh use strategy='hsdp')"
            )
    buckets = _bucket_table(model, bucket_cap_mb)
    sharding.shard_parameters(model, mesh, param_dtype=param_dtype)
    roles = (AxisRole.SHARD,) if mesh.ndim == 1 else (AxisRole.REPLICATE, AxisRole.SHARD)
    _record_plan(model, ParallelPlan(
        Strategy(strategy), _axes(mesh, roles), buckets, max_inflight_gathers, param_dtype, reduce_dtype,
    ))
    optimizer_hooks.watch_optimizers()
    return model


def _mesh_device_type(model: nn.Module) -> str:
    """The device type of the meshes ``parallelize`` builds: the parameters', or for a model still on the meta
    device (materialized later with ``to_empty``) the one the default process group's backend serves."""
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    if device_type == "meta":
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return device_type


def _check_sync_every(strategy: str, sync_every: int | None) -> None:
    if strategy != "local_sgd":
        if sync_every is not None:
            raise OptionsError(
                f"sync_every sets how often strategy='local_sgd' averages its replicas; {strategy!r} synchronises "
                "gradients every step: drop sync_every, or choose strategy='local_sgd'"
            )
        return
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise OptionsError(
            f"strategy='local_sgd' needs sync_every, the number of optimizer steps between averages, as an integer "
            f">= 1 (1 averages after every step), got {sync_every!r}"
        )


def _parallelize_replicated(
    model: nn.Module,
    strategy: Strategy,
    mesh: DeviceMesh | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    world: int,
    device_type: str,
    sync_every: int | None,
) -> DeviceMesh:
    """zero1 and local_sgd: whole parameters over the whole world, as under ddp; their plan recorded."""
    if param_dtype is not None or reduce_dtype is not None:
        raise OptionsError(f"param_dtype/reduce_dtype apply to zero2 and fsdp; for {strategy.value} use torch.autocast")
    mesh = mesh if mesh is not None else init_device_mesh(device_type, (world,))
    if mesh.ndim != 1 or mesh.size() != world:
        raise OptionsError(
            f"strategy {strategy.value!r} replicates over the whole world ({world} ranks) on a 1-D mesh, got mesh "
            f"shape {tuple(mesh.shape)}; omit mesh"
        )
    _record_plan(model, ParallelPlan(strategy, _axes(mesh, (AxisRole.REPLICATE,)), sync_every=sync_every))
    return mesh


def _bucket_table(model: nn.Module, bucket_cap_mb: float | None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Bucket -> its parameters' names in module order, as ``ParallelPlan.buckets`` holds them."""
    bucket_of = _sharded_buckets(model, bucket_cap_mb)
    buckets: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        buckets.setdefault(bucket_of[name], []).append(name)
    return tuple((b, tuple(names)) for b, names in buckets.items())


def _axes(mesh: DeviceMesh, roles: tuple[AxisRole, ...]) -> tuple[MeshAxis, ...]:
    names = mesh.mesh_dim_names or tuple(role.value for role in roles)
    return tuple(
        MeshAxis(name, role, mesh.size(dim), mesh.get_group(dim).group_name)
        for dim, (name, role) in enumerate(zip(names, roles))
    )


def _record_plan(model: nn.Module, plan: ParallelPlan) -> None:
    """The plan the backend reads, kept in ``model``'s ModelState (see [Note: facts keyed by name, not by tensor])."""
    attach(plan, model)


def _tensor_parallel_mesh(strategy: str, mesh: DeviceMesh | None, world: int, device_type: str) -> tuple[DeviceMesh | None, DeviceMesh]:
    """(data-parallel sub-mesh or None, tensor-parallel sub-mesh), checked against the world."""
    if strategy == "tp":
        mesh = mesh if mesh is not None else init_device_mesh(device_type, (world,))
        if mesh.ndim != 1 or mesh.size() != world:
            raise OptionsError(
                f"strategy 'tp' needs a 1-D mesh over the whole world ({world} ranks), got mesh shape "
                f"{tuple(mesh.shape)}; for a 2-D mesh use 'ddp+tp' or 'fsdp+tp'"
            )
        return None, mesh
    if mesh is None or mesh.ndim != 2 or mesh.size() != world:
        shape = tuple(mesh.shape) if mesh is not None else None
        raise OptionsError(
            f"strategy {strategy!r} needs a 2-D mesh (dp, tp) over the whole world ({world} ranks), got "
            f"{shape}; e.g. init_device_mesh({device_type!r}, (2, {max(world // 2, 1)}), mesh_dim_names=('dp', 'tp'))"
        )
    if mesh.mesh_dim_names is None or sorted(mesh.mesh_dim_names) != ["dp", "tp"]:
        raise OptionsError(
            f"strategy {strategy!r} needs the 2-D mesh's dimensions named ('dp', 'tp'), got "
            f"{mesh.mesh_dim_names}; pass init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    return mesh["dp"], mesh["tp"]


def _mesh_of_plan(model: nn.Module, plan: Plan, ranks: torch.Tensor | None = None) -> DeviceMesh:
    """The mesh ``parallelize`` takes for ``plan`` (already ``as_run``): one flat data-parallel
    group, ``(world,)`` for tp alone, or ``("dp", "tp")`` with the dp axes folded into one.

    ``ranks`` (default: ranks in order, ``plan.mesh_shape``) places every rank on the plan's
    axes, so the tp group is the one the plan priced on the tp axis's links.
    """
    device_type = _mesh_device_type(model)
    ranks = ranks if ranks is not None else torch.arange(math.prod(plan.mesh_shape)).reshape(plan.mesh_shape)
    if "tp" not in plan.mesh_dim_names or plan.data_parallel_degree == 1:  # the other axes have size 1
        return DeviceMesh(device_type, ranks.flatten())
    tp = plan.mesh_dim_names.index("tp")
    grouped = ranks.permute(*plan.data_axes, tp).reshape(plan.data_parallel_degree, plan.mesh_shape[tp])
    return DeviceMesh(device_type, grouped, mesh_dim_names=("dp", "tp"))


def _parallelize_auto(
    model: nn.Module,
    mesh: DeviceMesh | None,
    example_inputs: Sequence[Any] | None,
    memory_budget_gb: float | None,
    world: int,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> nn.Module:
    """Plan on the given mesh's shape (default: the whole world in 1-D), then apply the plan.

    ``example_inputs`` is this rank's slice; every rank is fed different rows, so the planner
    prices the global batch of ``world`` slices (see [Note: which mesh axes split the data]).
    """
    from dpar.planning import global_batch, plan as make_plan

    if example_inputs is None:
        raise OptionsError("strategy 'auto' plans from one batch: pass example_inputs=(this rank's slice, ...)")
    shape = tuple(mesh.shape) if mesh is not None else (world,)
    chosen = make_plan(model, global_batch(example_inputs, world), mesh_shape=shape, memory_budget_gb=memory_budget_gb)
    placed = _mesh_of_plan(model, chosen.as_run(), mesh.mesh) if mesh is not None else None  # keep the given ranks' places
    return parallelize(model, plan=chosen, mesh=placed, param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _parallelize_tensor_parallel(
    model: nn.Module,
    strategy: str,
    mesh: DeviceMesh | None,
    tp_plan: dict[str, int | None] | None,
    example_inputs: Sequence[Any] | None,
    world: int,
    device_type: str,
    max_inflight_gathers: int | None,
    sequence_parallel: bool,
    same_batch_in_tp_group: bool,
    bucket_cap_mb: float | None,
) -> None:
    dp_mesh, tp_mesh = _tensor_parallel_mesh(strategy, mesh, world, device_type)
    if tp_plan is None:
        if example_inputs is None:
            raise OptionsError(
                f"strategy {strategy!r} needs to know which dimension of each parameter to split: pass "
                "example_inputs=(...) (one batch; the forward runs once on fake tensors to pair "
                "column- and row-parallel layers) or tp_plan={name: dim or None}"
            )
        tp_plan = megatron_dims(model, example_inputs)
    chosen = Strategy(strategy)
    splits = tensor_parallel.split_parameters(model, tp_plan, tp_mesh.get_group())
    buckets = _bucket_table(model, bucket_cap_mb) if chosen.shards_parameters else ()
    if chosen.shards_parameters:
        sharding.shard_parameters(model, dp_mesh)
    tensor_parallel.install_markers(model, splits, tensor_parallel.state_dict_mesh(tp_mesh, dp_mesh, mesh))
    if dp_mesh is None:
        axes = _axes(tp_mesh, (AxisRole.TENSOR,))
    else:
        data_role = AxisRole.SHARD if chosen.shards_parameters else AxisRole.REPLICATE
        axes = tuple(
            _axes(mesh[name], (AxisRole.TENSOR if name == "tp" else data_role,))[0] for name in mesh.mesh_dim_names
        )
    _record_plan(model, ParallelPlan(
        chosen, axes, buckets, max_inflight_gathers,
        sequence_parallel=sequence_parallel, same_batch_in_tp_group=same_batch_in_tp_group,
    ))


def plan_of(model: nn.Module) -> ParallelPlan | None:
    """What ``parallelize`` decided for ``model`` (None: it was not called, or chose ddp)."""
    return plan_of_model(model)


__all__ = ["STRATEGIES", "parallelize", "plan_of"]
