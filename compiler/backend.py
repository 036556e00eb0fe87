"""The ``dpar`` backend that ``torch.compile`` calls with each graph Dynamo captures."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor

from dpar.compiler.capture import GraphInput, InputKind, classify_inputs
from dpar.compiler.lowering import GraphRole, Lower, compile_graphs
from dpar.compiler.options import Options
from dpar.compiler.pipeline import joint_pipeline
from dpar.compiler.data_parallel import DataParallelHook
from dpar.compiler.sharded_data_parallel import ShardedDataParallelHook
from dpar.compiler.passes.group_batch import GroupBatch, mark_own_rows
from dpar.compiler.tensor_parallel import TensorParallelHook, ThenInference, tensor_parallel_mesh
from dpar.runtime.errors import OptionsError
from dpar.runtime.replicate import synchronize_replicas
from dpar.runtime.same_rows import checking_same_rows
from dpar.runtime.sharding import ShardSpec, spec_of
from dpar.runtime.tensor_parallel import TensorParallelSpec, tensor_parallel_spec_of
from dpar.runtime.world import World, check_devices, current_world


def _single_device_hook(
    gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower
) -> Callable[..., Any]:
    return lower(gm, example_inputs)


def dpar_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Data parallel over the default process group: replicate, bucketed all-reduce in backward."""
    parsed = Options.parse(options)
    if mode is not None:
        raise OptionsError(
            f"torch.compile(mode={mode!r}) is not supported with backend='dpar'; choose the inner "
            "compiler with options={'compiler': 'inductor' | 'aot_eager' | 'eager'}"
        )
    world = current_world()
    if world is None:
        return compile_graphs(gm, example_inputs, compiler=parsed.compiler, hook=_single_device_hook)
    if not torch.is_grad_enabled():
        # A no_grad forward (evaluation) reads local buffers, as DDP's does unless it directly follows a
        # training forward: its graph then has no collectives and may run on some ranks only.
        parsed = dataclasses.replace(parsed, broadcast_buffers=False)
    inputs = classify_inputs(gm, example_inputs)
    state = [(i.kind.value, i.name, i.tensor()) for i in inputs if i.kind is not InputKind.DATA]
    check_devices({name: t for kind, name, t in state if kind == "parameter"}, world)
    specs = {i.index: spec_of(i.tensor()) for i in inputs if i.kind is InputKind.PARAMETER}
    specs = {index: spec for index, spec in specs.items() if spec is not None}
    split = [tensor_parallel_spec_of(i.tensor()) for i in inputs if i.kind is InputKind.PARAMETER]
    split = [s for s in split if s is not None]
    if parsed.bucket_cap_mb is not None and (specs or (split and split[0].data_parallel_group_name is None)):
        raise OptionsError(
            "options={'bucket_cap_mb': ...} sizes ddp's gradient buckets; these parameters are "
            + ("sharded, and their buckets are laid out by parallelize: pass dpar.parallelize(model, "
               "strategy=..., bucket_cap_mb=...) and leave it out of torch.compile's options" if specs else
               "split by strategy 'tp', which has no gradient buckets: leave bucket_cap_mb out")
        )
    if split:
        return _compile_tensor_parallel(gm, example_inputs, inputs, state, specs, split[0], world, parsed)
    if not specs:
        synchronize_replicas(state, world, parsed.check_timeout_s)
        hook = DataParallelHook(inputs, world, parsed)
        return compile_graphs(gm, example_inputs, compiler=parsed.compiler, hook=hook)
    # Shards were scattered from rank 0 by parallelize; buffers still start from rank 0's.
    synchronize_replicas([s for s in state if not isinstance(s[2], DTensor)], world, parsed.check_timeout_s)
    sharded = ShardedDataParallelHook(inputs, specs, world, parsed)
    return compile_graphs(
        gm, example_inputs, compiler=parsed.compiler, hook=sharded, joint_pass=joint_pipeline(sharded.joint_passes())
    )


def _compile_tensor_parallel(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    inputs: Sequence[GraphInput],
    state: list[tuple[str, str, torch.Tensor]],
    specs: dict[int, ShardSpec],
    split: TensorParallelSpec,
    world: World,
    options: Options,
) -> Callable[..., Any]:
    """tp, ddp+tp, fsdp+tp: the tensor-parallel pass first, then the data-parallel strategy's hook."""
    mesh = tensor_parallel_mesh(split)
    data = [i.index for i in inputs if i.kind is InputKind.DATA]
    group_batch = None
    if not split.same_batch_in_group:  # each rank's own rows: see [Note: the data contract under tensor parallel]
        group_batch = GroupBatch(mesh.size, mesh.rank, mesh.group_name)
        gm = mark_own_rows(gm, data)
    # Blocks of split parameters differ by rank; parallelize broadcast them before splitting.
    replicas = [
        (k, n, t) for k, n, t in state
        if not isinstance(t, DTensor) and getattr(tensor_parallel_spec_of(t), "dim", None) is None
    ]
    synchronize_replicas(replicas, world, options.check_timeout_s)
    if specs:  # fsdp+tp
        sharded = ShardedDataParallelHook(inputs, specs, world, options)
        hook = ThenInference(mesh, sharded, group_batch)
        joint = hook.joint_passes() + sharded.joint_passes()
    elif split.data_parallel_group_name is not None:  # ddp+tp
        dp_world = current_world(_resolve_process_group(split.data_parallel_group_name))
        hook = ThenInference(mesh, DataParallelHook(inputs, dp_world, options, whole_group=world.group_name), group_batch)
        joint = hook.joint_passes()
    else:
        hook = ThenInference(mesh, TensorParallelHook(inputs, world, options), group_batch)
        joint = hook.joint_passes()
    compiled = compile_graphs(
        gm, example_inputs, compiler=options.compiler, hook=hook, joint_pass=joint_pipeline(joint)
    )
    if group_batch is None and world.backend != "fake":
        return checking_same_rows(compiled, data, split.group_name)
    return compiled


def register() -> None:
    """Make ``backend="dpar"`` resolvable even where the entry point is not installed."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "dpar" not in _BACKENDS:
        register_backend(name="dpar")(dpar_backend)
