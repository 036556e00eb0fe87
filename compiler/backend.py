"""The ``dpar`` backend that ``torch.compile`` calls with each graph Dynamo captures."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from dpar.compiler.capture import GraphInput, InputKind, classify_inputs
from dpar.compiler.lowering import GraphHook, GraphRole, Lower, compile_graphs
from dpar.compiler.options import Options
from dpar.compiler.pass_listing import PassListing
from dpar.compiler.per_model import PerModel, graph_copy
from dpar.compiler.registry import counting_figures
from dpar.compiler.wrapped_twice import check_not_wrapped
from dpar.core.plan import ParallelPlan, Strategy, check_bucket_cap, plan_of_parameters, replicated
from dpar.compiler.sharded_data_parallel import flat_layout
from dpar.compiler.optimizer_step import OPTIMIZER_STAGE
from dpar.core.errors import OptionsError
from dpar.core.facts import period_of, tensor_parallel_spec_of
from dpar.runtime.finite_gradients import FiniteGradients
from dpar.runtime.liveness import compiling
from dpar.core.model_state import check_materialized
from dpar.core.torch_internals import register_dynamo_backend, resolve_process_group
from dpar.runtime.optimizer_hooks import hand_down
from dpar.runtime.replicate import synchronize_replicas
from dpar.runtime.same_rows import checking_same_rows
from dpar.runtime.sharding import uneven_shards_padded_once
from dpar.core.world import check_devices, current_world
from dpar.surgery.zero1 import shard_optimizer_state


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
    """Each graph through the passes of its parameters' plan (``dpar.parallelize``'s; none: ddp over
    the default process group), compiled again for each other model that calls it
    ([Note: one capture, several models] in ``per_model.py``)."""
    parameters = [i for i in classify_inputs(gm, example_inputs) if i.kind is InputKind.PARAMETER]
    if not parameters or current_world() is None or counting_figures():  # one device: nothing of a plan in the graphs;
        return _compiled(gm, example_inputs, options=options, mode=mode)  # a count: one model, its figures read
    captured = graph_copy(gm)
    compiled = _compiled(gm, example_inputs, options=options, mode=mode)
    position = parameters[0].index
    return PerModel(captured, lambda g, ex: _compiled(g, ex, options=options, mode=mode), position, compiled,
                    example_inputs[position])


@compiling()  # a rank compiling is not stalled: see [Note: a rank that vanishes]
def _compiled(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    parsed = Options.parse(options)
    if mode is not None:
        raise OptionsError(
            f"torch.compile(mode={mode!r}) is not supported with backend='dpar'; choose the inner "
            "compiler with options={'compiler': 'inductor' | 'aot_eager' | 'eager'}"
        )
    inputs = classify_inputs(gm, example_inputs)
    state = [(i.kind.value, i.name, i.tensor()) for i in inputs if i.kind is not InputKind.DATA]
    world = current_world()
    if world is None or world.backend != "fake":  # the fake process group prices models on paper (meta) as they are
        check_materialized(state)
    if world is None:
        hook = _single_device_hook
        if parsed.check_finite:
            hook = _checking_finite(hook, inputs, agree=False)
        return compile_graphs(gm, example_inputs, compiler=parsed.compiler, hook=hook)
    if not torch.is_grad_enabled():
        # A no_grad forward (evaluation) reads local buffers, as DDP's does unless it directly follows a
        # training forward: its graph then has no collectives and may run on some ranks only.
        parsed = dataclasses.replace(parsed, broadcast_buffers=False)
    check_not_wrapped({name: t for kind, name, t in state if kind == "parameter"})
    check_devices({name: t for kind, name, t in state if kind == "parameter"}, world)
    plan = plan_of_parameters({name: t for kind, name, t in state if kind == "parameter"})
    plan = plan if plan is not None else replicated(world.group_name, world.size)
    check_bucket_cap(plan.strategy, "compile", parsed.bucket_cap_mb)  # ddp's buckets are sized here; a sharded plan's by parallelize
    if plan.strategy is Strategy.ZERO1:  # a model materialized after parallelize (to_empty, assign=True) has new tensors
        group = resolve_process_group(plan.axes[0].group_name)
        shard_optimizer_state((t for kind, _, t in state if kind == "parameter"), group)
    # Shards and tensor-parallel blocks were placed by parallelize (from rank 0's values); every
    # whole tensor still starts from rank 0's.
    whole = [s for s in state if not isinstance(s[2], DTensor) and tensor_parallel_spec_of(s[2]) is None]
    synchronize_replicas(whole, world, parsed.check_timeout_s, broadcast=not _resumed_local_sgd(plan, state))
    # The optimizer stage, handed to the runtime's optimizer hooks (see [Note: optimizer hooks, per optimizer]).
    in_graph = [i.tensor() for i in inputs if i.kind is InputKind.PARAMETER and i.requires_grad]
    hand_down(OPTIMIZER_STAGE, (t for kind, _, t in state if kind == "parameter"),
              in_graph if parsed.steps_optimizer_in_graph else ())
    passes = PassListing(plan, inputs, world, parsed)
    gm = passes.prepare(gm)
    hook: GraphHook = passes
    if parsed.check_finite:  # ddp's and zero1's reduced gradients are the same on every rank
        hook = _checking_finite(hook, inputs, agree=not plan.strategy.identical_gradients)
    # See [Note: uneven shards, one pad] in runtime/sharding.py.
    with uneven_shards_padded_once() if plan.strategy.shards_parameters else contextlib.nullcontext():
        compiled = compile_graphs(gm, example_inputs, compiler=parsed.compiler, hook=hook, joint_pass=passes.joint())
    data = [i.index for i in inputs if i.kind is InputKind.DATA]
    if plan.same_batch_in_tp_group and world.backend != "fake":
        compiled = checking_same_rows(compiled, data, passes.tensor.mesh.group_name)
    if plan.same_batch_in_cp_group and world.backend != "fake":
        compiled = checking_same_rows(compiled, data, passes.context.group_name, "same_batch_in_cp_group", "context-parallel")
    return compiled


def _checking_finite(hook: GraphHook, inputs: Sequence[GraphInput], agree: bool) -> GraphHook:
    """``hook``, each backward it compiles wrapped by ``FiniteGradients`` (options={"check_finite": True}).

    A DTensor input flattens into several forward inputs and gradient outputs: where each parameter's
    gradient is among the backward's outputs is read off the forward's flat inputs, compiled first.
    """
    gradients: dict[int, tuple[str, Any]] = {}

    def checked(gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower) -> Callable[..., Any]:
        compiled = hook(gm, example_inputs, role, lower)
        if role is GraphRole.FORWARD:
            layout = flat_layout(inputs, example_inputs)
            gradients.update({layout[i.index][1]: (i.name, i.tensor) for i in inputs if i.kind is InputKind.PARAMETER})
        return FiniteGradients(compiled, gradients, agree) if role is GraphRole.BACKWARD else compiled

    return checked


def _resumed_local_sgd(plan: ParallelPlan, state: list[tuple[str, str, torch.Tensor]]) -> bool:
    """Local SGD replicas loaded mid-period differ by rank on purpose: broadcasting rank 0's would
    lose the others' local steps."""
    if plan.strategy is not Strategy.LOCAL_SGD:
        return False
    period = next((period_of(t) for kind, _, t in state if kind == "parameter"), None)
    return period is not None and period.steps > 0


def register() -> None:
    """Make ``backend="dpar"`` resolvable even where the entry point is not installed."""
    register_dynamo_backend("dpar", dpar_backend)
