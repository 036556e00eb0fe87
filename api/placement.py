"""``dpar.parallelize``: choose how parameters are placed before the model is compiled."""

from __future__ import annotations

import dataclasses
import difflib
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dpar.runtime import sharding
from dpar.runtime.errors import OptionsError, ProcessGroupError

STRATEGIES = ("ddp", "zero2", "fsdp", "hsdp")


@dataclasses.dataclass(frozen=True)
class ShardedPlan:
    """What ``parallelize`` decided; the backend reads the per-parameter part from the shards."""

    strategy: str
    mesh_shape: tuple[int, ...]
    buckets: dict[str, tuple[str, ...]]  # bucket -> parameter names, in module order
    max_inflight_gathers: int


_plans: weakref.WeakKeyDictionary[nn.Module, ShardedPlan] = weakref.WeakKeyDictionary()


def _buckets_by_cap(names: list[str], sizes: dict[str, int], cap_bytes: int) -> dict[str, str]:
    bucket_of, index, filled = {}, 0, 0
    for name in names:
        bucket_of[name] = f"bucket{index}"
        filled += sizes[name]
        if filled >= cap_bytes:
            index, filled = index + 1, 0
    return bucket_of


def parallelize(
    model: nn.Module,
    *,
    strategy: str = "fsdp",
    mesh: DeviceMesh | None = None,
    bucket_cap_mb: float | None = None,
    max_inflight_gathers: int = 1,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters in place for ``strategy``; build the optimizer afterwards.

    ``hsdp`` shards over the second dimension of a 2-D ``mesh`` and replicates
    over the first. ``bucket_cap_mb=None`` groups parameters per numbered block (``layers.3``), the
    rest in one ``root`` bucket; a number groups consecutive parameters up to that
    many MiB instead. ``max_inflight_gathers`` bounds how many all-gathers may be
    issued ahead of their use (the memory prefetch costs). ``param_dtype`` (e.g.
    ``torch.bfloat16``) is the dtype parameters are gathered and computed in, and
    ``reduce_dtype`` the one gradients are reduce-scattered in; shards, their
    gradients and the optimizer state stay in the stored dtype (float32).
    """
    if strategy not in STRATEGIES:
        close = difflib.get_close_matches(str(strategy), STRATEGIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise OptionsError(f"unknown strategy {strategy!r}{hint}; choose one of {list(STRATEGIES)}")
    if model in _plans or sharding.is_sharded(model):
        raise OptionsError(
            "parallelize was already called on this model; build a fresh model to choose another strategy"
        )
    if not isinstance(max_inflight_gathers, int) or max_inflight_gathers < 1:
        raise OptionsError(f"max_inflight_gathers must be an integer >= 1, got {max_inflight_gathers!r}")
    if bucket_cap_mb is not None and not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
        raise OptionsError(f"bucket_cap_mb must be None (per block) or a number > 0, got {bucket_cap_mb!r}")
    for knob, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise OptionsError(f"{knob} must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")
    if strategy == "ddp":
        if param_dtype is not None or reduce_dtype is not None:
            raise OptionsError("param_dtype/reduce_dtype apply to zero2 and fsdp; for ddp use torch.autocast")
        return model  # replication needs no change at rest: the backend inserts the all-reduces
    if not dist.is_initialized():
        raise ProcessGroupError(
            f"strategy {strategy!r} shards parameters over ranks, but torch.distributed is not "
            "initialized: call torch.distributed.init_process_group() before dpar.parallelize"
        )
    world = dist.get_world_size()
    device_type = next((p.device.type for p in model.parameters()), "cpu")
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
    named = [(n, p) for n, p in model.named_parameters()]
    names = [n for n, _ in named]
    if bucket_cap_mb is None:
        bucket_of = {n: sharding.block_of(n) for n in names}
    else:
        sizes = {n: p.numel() * p.element_size() for n, p in named}
        bucket_of = _buckets_by_cap(names, sizes, int(bucket_cap_mb * 1024 * 1024))
    sharding.shard_parameters(
        model, mesh, strategy, bucket_of, max_inflight_gathers, param_dtype=param_dtype, reduce_dtype=reduce_dtype
    )
    buckets: dict[str, list[str]] = {}
    for name in names:
        buckets.setdefault(bucket_of[name], []).append(name)
    _plans[model] = ShardedPlan(
        strategy=strategy,
        mesh_shape=tuple(mesh.shape),
        buckets={b: tuple(ns) for b, ns in buckets.items()},
        max_inflight_gathers=max_inflight_gathers,
    )
    sharding.guard_optimizers_built_too_early()
    return model


def plan_of(model: nn.Module) -> ShardedPlan | None:
    return _plans.get(getattr(model, "_orig_mod", model))


__all__ = ["STRATEGIES", "ShardedPlan", "parallelize", "plan_of"]
