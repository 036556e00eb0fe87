"""``dpar.parallelize``: choose how parameters are placed before the model is compiled.

Written as data: ``ACCEPTS`` says which options each strategy takes (one message refusing each to
the others), ``_mesh_refusal`` what mesh it needs, and one apply per axis role places the model
(``_split_tensor``, ``_shard``; a replicate axis changes nothing at rest), then the data-parallel
mode's own (``_APPLY_MODE``: zero1, local SGD). Every question about a strategy is asked of the
vocabulary in core/plan.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dpar.compiler.megatron import megatron_dims
from dpar.compiler.optimizer_step import OPTIMIZER_STAGE
from dpar.core.plan import (
    ATTENTION_EXCHANGES, KEEP_ACTIVATIONS, ActivationPolicy, AxisRole, DataParallel, MeshAxis, ParallelPlan, Recompute, Strategy, attach,
    check_bucket_cap, plan_of_model, replicated,
)
from dpar.core import model_state
from dpar import initialization
from dpar.runtime import eager_guard, forward_scope, optimizer_hooks, parameter_writes
from dpar.surgery import expert_parallel, local_sgd, sharding, tensor_parallel, zero1
from dpar.surgery.blocks import model_blocks
from dpar.core.errors import ActivationPolicyError, OptionsError, PipelineAdviceWarning, ProcessGroupError

if TYPE_CHECKING:
    from dpar.planner.plan import Plan

STRATEGIES = (*(s.value for s in Strategy), "auto")
TENSOR_PARALLEL = tuple(s.value for s in Strategy if s.tensor_parallel and not s.context_parallel)


def _taking(accepts: Callable[[Strategy], bool], auto: bool = False) -> frozenset[str]:
    return frozenset(s.value for s in Strategy if accepts(s)) | ({"auto"} if auto else set())


_MIXED_PRECISION = _taking(  # auto: its plan decides
    lambda s: s.shards_parameters and not s.tensor_parallel and not s.expert_parallel and not s.context_parallel,
    auto=True)
_DTYPES_REFUSED = (
    "{option} applies to the sharded strategies without a tensor, expert or context axis ("
    + ", ".join(sorted(_MIXED_PRECISION - {"auto"})) + "), which gather parameters in param_dtype and "
    "reduce-scatter gradients in reduce_dtype; for {strategy!r} use torch.autocast"
)

# The validation table: option -> (the strategies that take it, the message refusing it to the others).
# An option counts as given when it is not None or False; the message is formatted with the strategy's
# name and the value given.
ACCEPTS: dict[str, tuple[frozenset[str], str]] = {
    "sync_every": (_taking(lambda s: s is Strategy.LOCAL_SGD), (
        "sync_every sets how often strategy='local_sgd' averages its replicas; {strategy!r} synchronises "
        "gradients every step: drop sync_every, or choose strategy='local_sgd'")),
    "outer_optimizer": (_taking(lambda s: s is Strategy.LOCAL_SGD), (
        "outer_optimizer is local SGD's outer step (DiLoCo): pass strategy='local_sgd', sync_every=H, "
        "outer_optimizer=dpar.OuterSGD(lr=0.7, momentum=0.9); got strategy {strategy!r}, {value!r}")),
    "param_dtype": (_MIXED_PRECISION, _DTYPES_REFUSED),
    "reduce_dtype": (_MIXED_PRECISION, _DTYPES_REFUSED),
    "same_batch_in_tp_group": (_taking(lambda s: s.tensor_parallel), (
        "same_batch_in_tp_group says every rank of a tensor-parallel group is fed the same rows; strategy "
        "{strategy!r} has no such group: feed every rank its own slice, as with DDP")),
    "same_batch_in_cp_group": (_taking(lambda s: s.context_parallel), (
        "same_batch_in_cp_group says every rank of a context-parallel group is fed the same rows; strategy "
        "{strategy!r} has no such group: feed every rank its own slice, as with DDP")),
    "attention_exchange": (_taking(lambda s: s.context_parallel), (
        "attention_exchange says how attention reads the other ranks' tokens over a context-parallel axis; "
        "strategy {strategy!r} splits no sequence: drop attention_exchange, or choose a cp strategy")),
    "sequence_parallel": (_taking(lambda s: s.tensor_parallel and not s.context_parallel), (
        "sequence_parallel splits the activations between tensor-parallel layers along the sequence; it needs a "
        f"tensor-parallel strategy without a cp axis, which splits the sequence itself "
        f"({', '.join(TENSOR_PARALLEL)}), not {{strategy!r}}")),
    # Every strategy takes it (tags on the joint graph, compiler/passes/recompute.py); refused nowhere.
    "activation_checkpointing": (_taking(lambda s: True, auto=True), ""),
}

ACTIVATION_POLICIES = tuple(r.value for r in Recompute)


def activation_policy(model: nn.Module, given: Any) -> ActivationPolicy:
    """``activation_checkpointing=`` as a policy: a name (``keep``, ``selective``, ``full``) for every block,
    ``{block: name}`` for the blocks named (the others keep), or an ``ActivationPolicy``. A block must be
    one of the model's (``model_blocks``), and a policy that recomputes needs a model with blocks."""
    if given is None:
        return KEEP_ACTIVATIONS
    prefix = "activation_checkpointing: "
    if isinstance(given, Recompute):
        policy = ActivationPolicy(given)
    elif isinstance(given, str):
        policy = ActivationPolicy(_recompute(given, prefix))
    elif isinstance(given, dict):
        policy = ActivationPolicy(blocks=tuple(
            (str(block), r if isinstance(r, Recompute) else _recompute(r, f"{prefix}block {block!r}: "))
            for block, r in given.items()))
    elif isinstance(given, ActivationPolicy):
        policy = given
    else:
        raise ActivationPolicyError(
            f"{prefix}expected one of {list(ACTIVATION_POLICIES)}, a dict {{block: policy}} such as "
            f"{{'layers.0': 'full'}}, or a dpar.ActivationPolicy; got {given!r}")
    budget = policy.budget_bytes
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ActivationPolicyError(f"{prefix}budget_bytes is saved-activation bytes per rank, an integer >= 0; got {budget!r}")
    if not policy.recomputes:
        return policy
    blocks = model_blocks(model)
    if not blocks:
        raise ActivationPolicyError(
            f"{prefix}{type(model).__name__} has no blocks to checkpoint: a block is a numbered child of an "
            "nn.ModuleList or nn.Sequential (layers.0, layers.1, ...); put the repeated layers in one, or pass 'keep'")
    unknown = [b for b, _ in policy.blocks if b not in blocks]
    if unknown:
        shown = ", ".join(blocks[:12]) + (f", ... ({len(blocks)} in all)" if len(blocks) > 12 else "")
        raise ActivationPolicyError(
            f"{prefix}{type(model).__name__} has no block {unknown[0]!r}; its blocks are: {shown}")
    return policy


def _recompute(name: Any, prefix: str) -> Recompute:
    try:
        return Recompute.parse(name, prefix)
    except OptionsError as refused:
        raise ActivationPolicyError(str(refused)) from None


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


def parallelize(
    model: nn.Module, *, strategy: str = "fsdp", mesh: DeviceMesh | None = None, bucket_cap_mb: float | None = None,
    max_inflight_gathers: int | None = None, param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None, tp_plan: dict[str, int | None] | None = None,
    example_inputs: Sequence[Any] | None = None, plan: Plan | None = None, memory_budget_gb: float | None = None,
    sequence_parallel: bool = False, same_batch_in_tp_group: bool = False, same_batch_in_cp_group: bool = False,
    sync_every: int | None = None,
    outer_optimizer: local_sgd.OuterSGD | None = None,
    activation_checkpointing: str | dict[str, str] | ActivationPolicy | None = None,
    attention_exchange: str | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters in place for ``strategy``; build the optimizer afterwards.

    ``tp`` splits layers over a 1-D ``mesh`` (Megatron: column- then row-parallel Linears, heads split, a tied
    embedding split by vocabulary); ``ddp+tp`` and ``zero2+tp``/``fsdp+tp`` take a 2-D mesh whose dimensions are
    named ``("dp", "tp")``. ``sequence_parallel=True`` (Megatron-SP) splits the token stream between the
    tensor-parallel layers along the sequence: each block's all-reduce becomes a reduce-scatter there and an
    all-gather before the next column-parallel layer, so norms and residuals hold 1/tp of the tokens. Every
    strategy takes DDP's data contract: each rank is fed its own slice of the global batch, and tensor parallel
    moves the rows a group needs itself; ``same_batch_in_tp_group=True`` says the user already feeds every rank
    of a tensor-parallel group the same rows (Megatron's habit), which the first steps check.

    ``cp`` splits each sequence over a 1-D ``mesh`` (context parallel); ``ddp+cp``, ``zero2+cp`` and ``fsdp+cp``
    take a 2-D mesh named ``("dp", "cp")``. Dim 1 of every input as long as the first input's dim 1 is the
    sequence, split in two chunks per rank (head and tail, so causal attention costs every rank alike);
    attention reads the keys and values all-gathered, or runs on 1/cp of the heads over whole sequences after an
    all-to-all (Ulysses): ``attention_exchange="all_gather"`` or ``"all_to_all"``, or None for the cheaper by
    bytes per attention. The loss is the mean over the whole sequence's tokens.
    Under DDP's contract each rank computes its share of every sequence of its group (DDP's numbers, DDP's
    activation memory); ``same_batch_in_cp_group=True`` says every rank of a cp group is fed the same rows
    (torchtitan's loader over "dp" only), and each then holds 1/cp of their activations. Which dimension of
    each parameter tensor parallel splits comes from ``tp_plan`` (name -> dim, None for replicated) or, without
    it, from the forward run once on ``example_inputs``. ``plan`` (from ``dpar.plan``) gives strategy, mesh and
    splits; ``strategy="auto"`` plans first, from ``example_inputs`` and ``memory_budget_gb``.

    ``hsdp`` shards over the second dimension of a 2-D ``mesh`` and replicates over the first.
    ``bucket_cap_mb=None`` groups parameters per numbered block (``layers.3``), the rest in one ``root`` bucket;
    a number groups consecutive parameters up to that many MiB instead (under ddp the same knob is a compile
    option, and is refused here). ``max_inflight_gathers`` bounds how many all-gathers may be issued ahead of
    their use (the memory prefetch costs); None chooses it from the cost model (compiler/passes/prefetch.py), 1
    where communication cannot overlap compute. ``param_dtype`` (e.g. ``torch.bfloat16``) is the dtype
    parameters are gathered and computed in, and ``reduce_dtype`` the one gradients are reduce-scattered in;
    shards, their gradients and the optimizer state stay in the stored dtype (float32).

    ``activation_checkpointing`` (every strategy): ``"keep"`` (the default) saves what the backward reads;
    ``"full"`` saves each block's input and computes the block's forward again in its backward;
    ``"selective"`` saves matmul and attention outputs and recomputes the cheap ops between them; a dict
    ``{"layers.0": "full", ...}`` chooses per block (the others keep), or pass a ``dpar.ActivationPolicy``.
    A block is a numbered layer (``layers.3``, ``transformer.h.0``). Collectives are never recomputed
    (a sharded parameter is not gathered again for the recomputation) and random ops are saved, so the
    numbers are those of training without checkpointing (compiler/passes/recompute.py).
    """
    if plan is not None and plan.pipeline is not None:
        raise OptionsError(f"parallelize: the plan is a pipeline ({plan.pipeline.describe}), which parallelize does not "
                           "run; run it with step = dpar.pipeline(model, loss_fn, example_inputs=..., plan=plan)")
    if plan is not None:  # a "tp" axis that splits no parameter runs as data parallel: see Plan.as_run
        if activation_checkpointing is None:  # the planner's choice, where it made one
            activation_checkpointing = plan.activations
        plan = plan.as_run()
        strategy, tp_plan = plan.strategy, plan.tp_dims()
        same_batch_in_cp_group = same_batch_in_cp_group or plan.same_batch_in_cp_group
        sequence_parallel = sequence_parallel or plan.sequence_parallel
        attention_exchange = attention_exchange or plan.attention_exchange
    options = dict(sync_every=sync_every, outer_optimizer=outer_optimizer, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   same_batch_in_tp_group=same_batch_in_tp_group, same_batch_in_cp_group=same_batch_in_cp_group,
                   sequence_parallel=sequence_parallel, attention_exchange=attention_exchange,
                   activation_checkpointing=activation_checkpointing)
    chosen = _checked(model, strategy, bucket_cap_mb, max_inflight_gathers, options)
    eager_guard.refuse_eager_training(model, strategy)  # see [Note: a model that never reaches the backend]
    forward_scope.count_eager_forwards(model)  # see [Note: a parameter is its parameter]
    options["activation_checkpointing"] = activations = activation_policy(model, activation_checkpointing)
    model_state.record_meta_state(model)  # see [Note: state of a model born on meta]
    if chosen is Strategy.DDP:
        # A replicate axis changes nothing at rest (the backend inserts the all-reduces); the state lets the
        # backend find the parameters by name through swap_tensors and load_state_dict(assign=True). A policy
        # that recomputes is the one thing ddp's plan holds beyond the default's.
        model_state.state_of(model, create=True)
        if activations.recomputes:
            _world(strategy)
            attach(dataclasses.replace(replicated(dist.group.WORLD.group_name, dist.get_world_size()),
                                       activations=activations), model)
        return model
    world, device_type = _world(strategy), _mesh_device_type(model)
    mesh = _mesh_of_plan(model, plan) if plan is not None and mesh is None else mesh
    if chosen is None:
        return _parallelize_auto(model, mesh, example_inputs, memory_budget_gb, world, param_dtype, reduce_dtype,
                                 activation_checkpointing)
    mesh = _checked_mesh(chosen, mesh, world, device_type)
    _place(model, chosen, mesh, tp_plan, example_inputs, bucket_cap_mb, max_inflight_gathers, options)
    return model


def _place(
    model: nn.Module, chosen: Strategy, mesh: DeviceMesh, tp_plan: dict[str, int | None] | None,
    example_inputs: Sequence[Any] | None, bucket_cap_mb: float | None, max_inflight_gathers: int | None,
    options: dict[str, Any],
) -> None:
    """Apply each axis role of ``chosen`` to ``model`` (tensor split first: buckets are laid out from the
    split parameters), record the plan, then the data-parallel mode's own step."""
    dp_mesh, tp_mesh = _sub_meshes(chosen, mesh)
    experts = ep_mesh = experts_dp_mesh = None
    if chosen.expert_parallel:
        ep_mesh, experts_dp_mesh = (mesh["ep"], mesh["dp"]) if mesh.ndim == 2 else (mesh, None)
        experts = expert_parallel.split_experts(model, ep_mesh)
    splits, tp_experts = _split_tensor(model, chosen, tp_mesh, tp_plan, example_inputs) if tp_mesh is not None else (None, None)
    if chosen.shards_parameters:  # under fsdp+ep the experts' blocks over "dp", the rest over every rank
        meshes = dict.fromkeys(experts.parameter_names(), experts_dp_mesh) if experts is not None else None
        buckets = _shard(model, dp_mesh, bucket_cap_mb, options["param_dtype"], meshes)
    else:
        buckets = ()
    if splits is not None:  # over ("dp", "tp"): parameters are whole over "cp"
        two_d = mesh["dp", "tp"] if mesh.ndim == 3 else mesh
        tensor_parallel.install_markers(model, splits, tensor_parallel.state_dict_mesh(tp_mesh, dp_mesh, two_d), tp_experts)
    if experts is not None:  # the experts' blocks enter state dicts as Shard(0) DTensors over the ep mesh
        experts.install(model, tensor_parallel.state_dict_mesh(ep_mesh, experts_dp_mesh, mesh, "ep"))
    attach(ParallelPlan(  # kept in model's ModelState (see [Note: facts keyed by name, not by tensor])
        chosen, _axes(mesh, _roles(chosen, mesh)), buckets, max_inflight_gathers, options["param_dtype"],
        options["reduce_dtype"], options["sequence_parallel"], options["same_batch_in_tp_group"],
        options["same_batch_in_cp_group"], options["sync_every"], options["activation_checkpointing"],
        _rows_group(chosen, mesh), options["attention_exchange"],
    ), model)
    if chosen.data_parallel in _APPLY_MODE:
        _APPLY_MODE[chosen.data_parallel](model, mesh, options["sync_every"], options["outer_optimizer"])
    if chosen.shards_parameters or chosen.tensor_parallel or chosen.expert_parallel:
        optimizer_hooks.watch_optimizers()
        parameter_writes.replay_writes_at_full_size()  # see [Note: a write the part cannot take as it stands]
        initialization.replay_own_initializers(model)  # see [Note: the model's own initializer, called on a ...]


def _rows_group(strategy: Strategy, mesh: DeviceMesh) -> MeshAxis | None:
    """Under cp and tp together, the two axes flattened into one group (``ParallelPlan.rows_group``)."""
    if not (strategy.context_parallel and strategy.tensor_parallel):
        return None
    flat = mesh["cp", "tp"]._flatten()
    return MeshAxis("cp_tp", AxisRole.TENSOR, flat.size(), flat.get_group().group_name)


def _world(strategy: str) -> int:
    """The world's size; every strategy but ddp places parameters over ranks, so needs the process group."""
    if not dist.is_initialized():
        raise ProcessGroupError(
            f"strategy {strategy!r} places parameters over ranks, but torch.distributed is not "
            "initialized: call torch.distributed.init_process_group() before dpar.parallelize"
        )
    return dist.get_world_size()


def _checked(
    model: nn.Module, strategy: str, bucket_cap_mb: float | None, max_inflight_gathers: int | None, options: dict[str, Any]
) -> Strategy | None:
    """The strategy named (None: ``auto``), once every option given is one it takes, with a value it can use."""
    chosen = None if strategy == "auto" else Strategy.parse(strategy)
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
    check_bucket_cap(chosen, "parallelize", bucket_cap_mb)
    sync_every = options["sync_every"]
    if chosen is Strategy.LOCAL_SGD and (isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1):
        raise OptionsError(
            f"strategy='local_sgd' needs sync_every, the number of optimizer steps between averages, as an integer "
            f">= 1 (1 averages after every step), got {sync_every!r}"
        )
    outer = options["outer_optimizer"]
    if outer is not None and not isinstance(outer, local_sgd.OuterSGD):
        raise OptionsError(ACCEPTS["outer_optimizer"][1].format(strategy=strategy, value=outer))
    if options["attention_exchange"] not in (None, *ATTENTION_EXCHANGES):
        raise OptionsError(
            f"attention_exchange must be one of {list(ATTENTION_EXCHANGES)}, or None to choose per attention by cost, got "
            f"{options['attention_exchange']!r}"
        )
    for knob in ("param_dtype", "reduce_dtype"):
        dtype = options[knob]
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise OptionsError(f"{knob} must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")
    for option, value in options.items():
        takers, refusal = ACCEPTS[option]
        if value is not None and value is not False and strategy not in takers:
            raise OptionsError(refusal.format(option=option, strategy=strategy, value=value))
    return chosen


def _mesh_refusal(strategy: Strategy, world: int, shape: tuple[int, ...] | None, device_type: str) -> str:
    """The one message refusing a mesh that is not the strategy's: one axis per role, over the whole world."""
    if len(strategy.roles) > 1:
        names, ndim = strategy.mesh_dim_names, len(strategy.roles)
        example = (2,) * (ndim - 1) + (max(world // 2 ** (ndim - 1), 1),)
        return (
            f"strategy {strategy.value!r} needs a {ndim}-D mesh ({', '.join(names)}) over the whole world ({world} "
            f"ranks), got {shape}; e.g. init_device_mesh({device_type!r}, {example}, mesh_dim_names={names})"
        )
    fix = {
        Strategy.TP: "for a 2-D mesh use 'ddp+tp' or 'fsdp+tp'",
        Strategy.EP: f"pass init_device_mesh(device, ({world},), mesh_dim_names=('ep',)) or omit mesh",
        Strategy.ZERO1: "omit mesh (it replicates over the whole world)",
        Strategy.LOCAL_SGD: "omit mesh (it replicates over the whole world)",
    }.get(strategy, f"pass init_device_mesh(device, ({world},)) or omit mesh (for a 2-D mesh use strategy='hsdp')")
    return (f"strategy {strategy.value!r} needs a 1-D mesh over the whole world ({world} ranks), got mesh "
            f"shape {shape}; {fix}")


def _checked_mesh(strategy: Strategy, mesh: DeviceMesh | None, world: int, device_type: str) -> DeviceMesh:
    """``mesh`` (default: the whole world, for a strategy of one axis) with one axis per role of ``strategy``;
    a data and a tensor axis are found by name (``dp``, ``tp``)."""
    ndim = len(strategy.roles)
    names = strategy.mesh_dim_names
    if mesh is None and ndim == 1:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=names if strategy.expert_parallel else None)
    if mesh is None or mesh.ndim != ndim or mesh.size() != world:
        raise OptionsError(_mesh_refusal(strategy, world, None if mesh is None else tuple(mesh.shape), device_type))
    named_by_role = strategy.expert_parallel or (strategy.context_parallel and (ndim == 1 or strategy.tensor_parallel))
    if named_by_role and mesh.mesh_dim_names not in ((None, names) if ndim == 1 else (names,)):
        raise OptionsError(
            f"strategy {strategy.value!r} needs the mesh's dimensions named {names}, got {mesh.mesh_dim_names}; "
            f"pass init_device_mesh(..., mesh_dim_names={names})"
        )
    if ndim == 2 and (strategy.tensor_parallel or strategy.context_parallel) and sorted(mesh.mesh_dim_names or ()) != sorted(names):
        raise OptionsError(
            f"strategy {strategy.value!r} needs the 2-D mesh's dimensions named {names}, got "
            f"{mesh.mesh_dim_names}; pass init_device_mesh(..., mesh_dim_names={names})"
        )
    return mesh


def _roles(strategy: Strategy, mesh: DeviceMesh) -> tuple[AxisRole, ...]:
    """Each mesh dimension's role: by position, or by name for a data and a tensor or context axis (either order)."""
    if (strategy.tensor_parallel != strategy.context_parallel) and mesh.ndim == 2:
        second = strategy.mesh_dim_names[1]
        return tuple(strategy.roles[1] if name == second else strategy.roles[0] for name in mesh.mesh_dim_names)
    return strategy.roles


def _sub_meshes(strategy: Strategy, mesh: DeviceMesh) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(the data axes' mesh, the tensor axis's mesh), None where the strategy has no such axis. Under ep the
    parameters outside the experts are data parallel over every rank: a 1-D mesh of the whole world."""
    if strategy.expert_parallel:
        return (mesh if mesh.ndim == 1 else DeviceMesh(mesh.device_type, torch.arange(mesh.size()))), None
    if strategy.context_parallel:  # parameters whole over "cp": the data axis only, if any
        dp_mesh = mesh["dp"] if "dp" in (mesh.mesh_dim_names or ()) else None
        return dp_mesh, (mesh["tp"] if strategy.tensor_parallel else None)
    if not strategy.tensor_parallel:
        return mesh, None
    return (mesh["dp"], mesh["tp"]) if mesh.ndim == 2 else (None, mesh)


def _split_tensor(
    model: nn.Module,
    strategy: Strategy,
    tp_mesh: DeviceMesh,
    tp_plan: dict[str, int | None] | None,
    example_inputs: Sequence[Any] | None,
) -> tuple[tensor_parallel.Splits, dict[nn.Module, Callable[..., Any]]]:
    """The tensor axis: split each parameter ``tp_plan`` names (Megatron) over ``tp_mesh``; without a
    ``tp_plan`` the split dims come from the forward run once on fake ``example_inputs``, and routed experts are
    spread over the axis by expert (see [Note: experts spread over a tensor-parallel group]). Returns the
    splits and the forwards of the experts modules split by expert."""
    if tp_plan is None and example_inputs is None:
        raise OptionsError(
            f"strategy {strategy.value!r} needs to know which dimension of each parameter to split: pass "
            "example_inputs=(...) (one batch; the forward runs once on fake tensors to pair "
            "column- and row-parallel layers) or tp_plan={name: dim or None}"
        )
    group, experts = tp_mesh.get_group(), expert_parallel.experts_modules(model)
    if tp_plan is None:
        tp_plan = expert_parallel.experts_by_expert(experts, megatron_dims(model, example_inputs), tp_mesh.size())
    splits = tensor_parallel.split_parameters(model, tp_plan, group)
    return splits, expert_parallel.local_expert_forwards(
        experts, splits, group.group_name, tp_mesh.size(), tp_mesh.get_local_rank())


def _shard(
    model: nn.Module, mesh: DeviceMesh, bucket_cap_mb: float | None, param_dtype: torch.dtype | None,
    meshes: dict[str, DeviceMesh] | None = None,
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The shard axis (with any replicate axis beside it, hsdp): each parameter becomes its dim-0 shard over
    ``mesh``'s last dimension (or over ``meshes[name]``); returns the bucket table, laid out from the
    (tensor- or expert-split) parameters first."""
    buckets = _bucket_table(model, bucket_cap_mb)
    sharding.shard_parameters(model, mesh, param_dtype=param_dtype, meshes=meshes)
    return buckets


def _apply_zero1(model: nn.Module, mesh: DeviceMesh, sync_every: int | None, outer: local_sgd.OuterSGD | None) -> None:
    """zero1: each rank's optimizer steps and keeps state for its range of each parameter."""
    zero1.shard_optimizer_state(model.parameters(), mesh.get_group())
    # The optimizer stage that steps them, from the first step on (dpar.checkpoint.load steps before compiling).
    optimizer_hooks.hand_down(OPTIMIZER_STAGE, model.parameters())


def _apply_local_sgd(model: nn.Module, mesh: DeviceMesh, sync_every: int | None, outer: local_sgd.OuterSGD | None) -> None:
    """local SGD: where the model is in its averaging period, read by the backend and saved with checkpoints."""
    local_sgd.attach(local_sgd.Period(sync_every, outer), model)


# The data-parallel modes that do something at parallelize beyond their axes' placement.
_APPLY_MODE: dict[DataParallel, Callable[[nn.Module, DeviceMesh, int | None, local_sgd.OuterSGD | None], None]] = {
    DataParallel.ZERO1: _apply_zero1,
    DataParallel.LOCAL_SGD: _apply_local_sgd,
}


def _mesh_device_type(model: nn.Module) -> str:
    """The device type of the meshes ``parallelize`` builds: the parameters', or for a model still on the meta
    device (materialized later with ``to_empty``) the one the default process group's backend serves."""
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    if device_type == "meta":
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return device_type


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


def _mesh_of_plan(model: nn.Module, plan: Plan, ranks: torch.Tensor | None = None) -> DeviceMesh:
    """The mesh ``parallelize`` takes for ``plan`` (already ``as_run``): one flat data-parallel
    group, ``(world,)`` for tp alone, ``("dp", "tp")`` with the dp axes folded into one, or the plan's own
    axes where it has an ep or a cp axis (planner/layout.py places them as the runtime takes them).

    ``ranks`` (default: ranks in order, ``plan.mesh_shape``) places every rank on the plan's
    axes, so the tp group is the one the plan priced on the tp axis's links.
    """
    device_type = _mesh_device_type(model)
    ranks = ranks if ranks is not None else torch.arange(math.prod(plan.mesh_shape)).reshape(plan.mesh_shape)
    if "ep" in plan.mesh_dim_names or "cp" in plan.mesh_dim_names:  # ("ep",) / ("dp", "ep"), and cp's: planner/layout.py
        return DeviceMesh(device_type, ranks, mesh_dim_names=plan.mesh_dim_names)
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
    activation_checkpointing: Any = None,
) -> nn.Module:
    """Plan on the given mesh's shape (default: the whole world in 1-D), then apply the plan.

    ``example_inputs`` is this rank's slice; every rank is fed different rows, so the planner
    prices the global batch of ``world`` slices (see [Note: which mesh axes split the data]).
    """
    from dpar.planning import global_batch, plan as make_plan

    if example_inputs is None:
        raise OptionsError("strategy 'auto' plans from one batch: pass example_inputs=(this rank's slice, ...)")
    shape = tuple(mesh.shape) if mesh is not None else (world,)
    batch = global_batch(example_inputs, world)
    chosen = make_plan(model, batch, mesh_shape=shape, memory_budget_gb=memory_budget_gb)
    if chosen.pipeline is not None:  # the answer parallelize cannot run: say it, apply the fastest placements
        warnings.warn(f"strategy 'auto': the fastest plan is a pipeline ({chosen.pipeline.describe}, "
                      f"{chosen.cost.step_s:.3g} s a step modelled); parallelize applies the fastest placement plan. "
                      "To run the pipeline: step = dpar.pipeline(model, loss_fn, example_inputs=..., "
                      "plan=dpar.plan(model, global_batch, mesh_shape=...))", PipelineAdviceWarning, stacklevel=3)
        chosen = make_plan(model, batch, mesh_shape=shape, memory_budget_gb=memory_budget_gb, pipelines=False)
    placed = _mesh_of_plan(model, chosen.as_run(), mesh.mesh) if mesh is not None else None  # keep the given ranks' places
    return parallelize(model, plan=chosen, mesh=placed, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                       activation_checkpointing=activation_checkpointing)


def plan_of(model: nn.Module) -> ParallelPlan | None:
    """What ``parallelize`` decided for ``model`` (None: it was not called, or chose ddp)."""
    return plan_of_model(model)


__all__ = ["ACTIVATION_POLICIES", "STRATEGIES", "activation_policy", "model_blocks", "parallelize", "plan_of"]
