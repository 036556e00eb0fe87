"""Checkpoints: sharded save and load with ``torch.distributed.checkpoint`` (DCP), and a full
state dict for plain PyTorch.

[Note: why model.state_dict() and not torch's get_state_dict]
``dpar.parallelize`` stores each parameter as a ``Shard(0)`` DTensor in ``module._parameters``
under its original name, so ``model.state_dict()`` already is what DCP wants: every rank's
shard of each global tensor. DCP writes each shard once and, on load, reads each rank's part
of the global tensors, whatever the world size that saved them (2 -> 4 ranks, or one plain
process) and whichever of fsdp / zero2 sharded them (same layout).

torch's ``get_state_dict`` / ``set_state_dict`` give the same numbers but resolve every
parameter name with ``getattr(module, name)``, which on a sharded module is the attribute that
returns the gathered full tensor (surgery/sharding.py): each call all-gathers every parameter
about three times, eagerly, outside the graph (86 gathers for the 28 parameters of the tiny
GPT; as many again in ``set_state_dict``). So the model goes through ``model.state_dict()``,
and the optimizer through ``optimizer.state_dict()`` keyed by parameter name, as torch's
``get_state_dict`` keys it. A parameter tensor parallel splits is a block in ``module._parameters``;
its module writes it to state dicts as the DTensor of the whole parameter (see [Note: a split
parameter in a state dict] in ``tensor_parallel.py``), and its optimizer state goes to DCP the same
way, so a tp checkpoint loads into any other strategy or a plain model, and back.

Hugging Face safetensors checkpoints (``load_safetensors`` / ``save_safetensors``) live in
``safetensors_io.py``: the same state-dict DTensors tell each rank which block of each tensor to read.
"""

from __future__ import annotations

import concurrent.futures
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

from dpar.runtime.checkpoint_files import publish, published, read_manifest, reached, staging_directory
from dpar.core.errors import CheckpointError, OptionsError, UnmaterializedStateError
from dpar.core import model_state
from dpar.core.facts import Period, any_zero1, period_of
from dpar.runtime import zero1
from dpar.runtime import safetensors_io
from dpar.runtime.safetensors_io import save_safetensors
from dpar.runtime.tensor_parallel import as_block, as_dtensor

CheckpointDir = str | os.PathLike[str]  # a directory: DCP writes one file per rank and a metadata file


def save(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: CheckpointDir) -> None:
    """Write every rank's shards of ``model`` (and ``optimizer``) as the checkpoint at ``path``.

    Call it on every rank: DCP agrees on who writes what with a collective plan. The checkpoint
    replaces the one at ``path`` only once it is complete (see [Note: publishing a checkpoint] in
    ``checkpoint_files.py``). Under local SGD and zero1 each rank's state is its own (see ``_per_rank``).
    """
    _wait_for_pending_save()
    state, fingerprint = _prepared(model, optimizer)
    staging = staging_directory(os.fspath(path), None)
    reached("staged")
    dcp.save(state, checkpoint_id=staging)
    reached("written")
    publish(staging, os.fspath(path), fingerprint, None)


def async_save(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, path: CheckpointDir
) -> concurrent.futures.Future[None]:
    """``save``, returning once the state is copied: a background thread writes and publishes it.

    Training may go on and change the parameters right away. The future completes when the
    checkpoint is published at ``path``; the next ``save``, ``async_save`` or ``load`` waits for it
    first (and raises its error, if it failed). The writes and their collectives go through a
    process group of their own, so they never interleave with the training's.
    """
    global _pending
    _wait_for_pending_save()
    state, fingerprint = _prepared(model, optimizer)
    group = _checkpoint_group()
    staging = staging_directory(os.fspath(path), group)
    reached("staged")
    upload = dcp.async_save(state, checkpoint_id=staging, process_group=group)

    def finish() -> None:
        upload.result()
        reached("written")
        publish(staging, os.fspath(path), fingerprint, group)

    _pending = _background().submit(finish)
    return _pending


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: CheckpointDir) -> None:
    """Read the checkpoint at ``path`` into ``model`` (and ``optimizer``) in place, on every rank.

    Works at any world size: DCP reshards the saved global tensors onto this run's shards,
    or into a plain model's full tensors without a process group (a local-SGD or zero1
    checkpoint resumes at the world size, and under the strategy, that saved it). Call it after
    ``dpar.parallelize`` and after the optimizer is built. Nothing is loaded unless every file
    matches the checkpoint's manifest and the manifest matches this model (``CheckpointError``).
    """
    _wait_for_pending_save()
    module = _unwrap(model)
    refuse_unmaterialized(module, "dpar.checkpoint.load")
    path = published(os.fspath(path))
    manifest = read_manifest(path)
    mine = _fingerprint(module, optimizer)
    whole_weights = _whole_weights_into_zero1(module, optimizer, manifest["fingerprint"])
    if whole_weights:
        mine = {**mine, "per_rank": False}
    _check_same_model(manifest["fingerprint"], mine, path)
    prefix = "" if whole_weights else _replica_prefix(module, path)
    state: dict[str, Any] = {"model": module.state_dict()}
    if optimizer is not None:
        _create_optimizer_state(optimizer)
        state["optimizer"] = _saved_part(_optimizer_state_by_name(module, optimizer), path, prefix)
        own_lists = {"param_groups": [dict(g) for g in state["optimizer"]["param_groups"]]}
    wrapped = state if whole_weights else _per_rank(module, state)
    dcp.load(wrapped, checkpoint_id=path)
    if optimizer is not None:
        state["optimizer"] = _own_parameter_lists(state["optimizer"], own_lists)
    # DCP filled the tensors in place; these also restore what it replaces (extra state, hyperparameters).
    module.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state_by_position(module, optimizer, state["optimizer"]))
    if "local_sgd" in wrapped:
        _period(module).load_state_dict(wrapped["local_sgd"])


def load_safetensors(model: nn.Module, directory: str | os.PathLike[str], **kwargs: Any) -> None:
    refuse_unmaterialized(_unwrap(model), "dpar.checkpoint.load_safetensors")
    safetensors_io.load_safetensors(model, directory, **kwargs)


load_safetensors.__doc__ = safetensors_io.load_safetensors.__doc__
load_safetensors.__wrapped__ = safetensors_io.load_safetensors  # inspect.signature shows its keywords


def refuse_unmaterialized(module: nn.Module, what: str) -> None:
    """Refuse, on every rank and before anything is read, to load into a model still on the meta device.

    A copy into a meta tensor does nothing, without an error: ``dcp.load`` and the safetensors reader "loaded"
    a model that ``parallelize`` left on meta (never ``to_empty``) and kept no value. Persistent state only (a
    non-persistent buffer is in no checkpoint; the first compile names one left unwritten). A pipelined model
    keeps its other stages' parameters elsewhere, its own concern.
    """
    if getattr(module, "_dpar_pipeline", None) is not None:
        return
    meta = next((name for name, t in _persistent(module) if model_state.is_meta(t)), None)
    if dist.is_initialized() and dist.get_world_size() > 1:  # a rank that refuses alone would leave the others waiting
        found: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, meta)
        meta = next((f"{name} (rank {rank})" for rank, name in enumerate(found) if name is not None), None)
    if meta is not None:
        raise UnmaterializedStateError(
            f"{what} into a model still on the meta device ({meta} has no memory): nothing was loaded. Give the "
            "model its memory first, model.to_empty(device=...) after dpar.parallelize (each rank allocates its "
            "own part), then load"
        )


def _persistent(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers, by name (what a state dict holds, without running its hooks)."""
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        yield from ((dot + n, p) for n, p in sub._parameters.items() if p is not None)
        yield from ((dot + n, b) for n, b in sub._buffers.items() if b is not None and n not in sub._non_persistent_buffers_set)


def _whole_weights_into_zero1(module: nn.Module, optimizer: torch.optim.Optimizer | None, saved: dict[str, Any]) -> bool:
    """Whether this is a zero1 model's weights alone from a checkpoint whose state no rank holds alone: zero1's
    parameters are whole and the same on every rank (only its optimizer state is per rank), so they load from any
    strategy's checkpoint at any world size, as ddp's do. Its optimizer ranges do not (``_check_same_model``)."""
    return (
        optimizer is None and not saved["per_rank"] and _period(module) is None
        and any_zero1(module.parameters())
    )


def _prepared(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """What DCP writes, and the fingerprint the manifest records."""
    module = _unwrap(model)
    fingerprint = _fingerprint(module, optimizer)
    state: dict[str, Any] = {"model": module.state_dict()}
    if optimizer is not None:
        state["optimizer"] = _optimizer_state_by_name(module, optimizer)
    return _per_rank(module, state), fingerprint


# [Note: async save]
# ``dcp.async_save`` copies the state to CPU memory (its default stager) before it returns and writes
# it in a thread. That thread's collectives (DCP's plan and metadata exchange, then ours: hashing and
# publishing) must not interleave with the training's on the default group, which would mix up the
# two sequences: they use a gloo group of their own, created once per default group on every rank. These
# three are the process's, not a model's: one background save at a time, whatever model it holds.
_pending: concurrent.futures.Future[None] | None = None
_executor: concurrent.futures.ThreadPoolExecutor | None = None
# Keyed weakly by the default group itself (an id could be reused by the next init_process_group's group).
_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def _wait_for_pending_save() -> None:
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    try:
        pending.result()
    except Exception as exc:
        raise CheckpointError(
            f"the previous dpar.checkpoint.async_save failed ({type(exc).__name__}: {exc}); the checkpoint "
            "published before it is intact. Fix the cause and save again"
        ) from exc


def _background() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpar-checkpoint")
    return _executor


def _checkpoint_group() -> dist.ProcessGroup | None:
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if world not in _groups:
        _groups[world] = dist.new_group(backend="gloo")
    return _groups[world]


def _fingerprint(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What a checkpoint must agree on with the model that loads it: every tensor's name, global shape
    and dtype, and where ranks hold state of their own, the strategy and world size."""
    from dpar.core.plan import plan_of_parameters  # the plan parallelize attached (runtime never imports compiler at import time)

    plan = plan_of_parameters(dict(module.named_parameters()))
    return {
        "tensors": _pipeline_tensors(module) or {
            name: [list(t.shape), str(t.dtype).removeprefix("torch.")]
            for name, t in module.state_dict().items() if isinstance(t, torch.Tensor)
        },
        "strategy": plan.strategy.value if plan is not None else "ddp" if dist.is_initialized() else "one process",
        "per_rank": _rank_local(module),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
    }


def _pipeline_tensors(module: nn.Module) -> dict[str, list[Any]] | None:
    """A ``dpar.pipeline`` model's fingerprint tensors: the whole model's, every rank's stages (each rank's
    ``state_dict()`` holds its own stages only; see [Note: a pipelined model's state] in ``api/pipelining.py``)."""
    pipelined = getattr(module, "_dpar_pipeline", None)
    if pipelined is None:
        return None
    pipelined.retie()  # before save and load read the state dict: to_empty untied a tied weight
    whole = pipelined.whole_model()
    return {name: [list(shape), str(dtype).removeprefix("torch.")] for name, (shape, dtype) in whole.items()}


def _own_parameter_lists(loaded: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The loaded optimizer state with each group's parameter names this optimizer's own.

    DCP keeps one copy of a value that is not a tensor; under ``dpar.pipeline`` each rank's optimizer holds its
    stages' parameters only, so the saved lists are one rank's, and a checkpoint of another layout lists
    parameters this rank does not hold. The hyperparameters come from the checkpoint, the names from here.
    """
    if len(loaded["param_groups"]) != len(own["param_groups"]):
        return loaded  # optimizer.load_state_dict names the mismatch
    groups = [{**group, "params": mine["params"]} for group, mine in zip(loaded["param_groups"], own["param_groups"])]
    return {**loaded, "param_groups": groups}


def _check_same_model(saved: dict[str, Any], mine: dict[str, Any], path: str) -> None:
    """Raise ``CheckpointError`` naming what differs, unless DCP can load ``saved`` into this model."""
    theirs, ours = saved["tensors"], mine["tensors"]
    differ = [
        f"{name} is {_described(theirs[name])} in the checkpoint, {_described(ours[name])} here"
        for name in ours if name in theirs and theirs[name] != ours[name]
    ]
    problems = [
        f"{what}: {_listed(names)}" for what, names in (
            ("not in this model", [name for name in theirs if name not in ours]),
            ("not in the checkpoint", [name for name in ours if name not in theirs]),
            ("shapes or dtypes differ", differ),
        ) if names
    ]
    if problems:
        raise CheckpointError(
            f"the checkpoint at {path!r} was saved from another model; {'; '.join(problems)}. Build the model with "
            "the configuration that saved it (dpar.checkpoint.full_state_dict and load_state_dict(strict=False) "
            "load part of one on purpose)"
        )
    if (saved["per_rank"] or mine["per_rank"]) and (saved["strategy"], saved["world_size"]) != (mine["strategy"], mine["world_size"]):
        where = f"saved under {saved['strategy']} on {saved['world_size']} rank(s); this run is {mine['strategy']} on {mine['world_size']}"
        if saved["per_rank"]:
            fix = (f"it holds each rank's own state (local SGD's replicas, zero1's optimizer ranges), so it resumes "
                   f"only under {saved['strategy']} on {saved['world_size']} rank(s)")
        else:
            fix = (f"{mine['strategy']} keeps a state per rank, which it does not hold: load it under ddp, zero2, fsdp "
                   f"or hsdp (at any world size), or resume this run from a checkpoint {mine['strategy']} saved")
            if mine["strategy"] == "zero1":
                fix += "; zero1 loads the weights alone from it (optimizer=None), its optimizer state starting afresh"
        raise CheckpointError(f"the checkpoint at {path!r} was {where}: {fix}")
    if mine["optimizer"] is not None and saved["optimizer"] not in (None, mine["optimizer"]):
        raise CheckpointError(
            f"the checkpoint at {path!r} holds {saved['optimizer']} state, and this optimizer is a "
            f"{mine['optimizer']}: build a {saved['optimizer']}, or load the model alone with optimizer=None"
        )


def _listed(items: list[str], shown: int = 4) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _described(entry: list[Any]) -> str:
    shape, dtype = entry
    return f"{dtype}{shape}"


def _period(module: nn.Module) -> Period | None:
    return next((period_of(p) for p in module.parameters()), None)


def _rank_local(module: nn.Module) -> bool:
    """Whether ranks hold different state under the same names: local SGD's replicas mid-period,
    zero1's optimizer ranges."""
    return _period(module) is not None or any_zero1(module.parameters())


def _per_rank(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` under this rank's own key where ranks differ (and local SGD's period beside it).

    DCP keeps one copy of a plain tensor every rank holds under one name: each rank's goes under
    ``replica<rank>`` instead.
    """
    if not _rank_local(module):
        return state
    wrapped = {f"replica{dist.get_rank()}": state}
    period = _period(module)
    if period is not None:
        wrapped["local_sgd"] = period.state_dict([p for p in module.parameters() if p.requires_grad])
    return wrapped


def _replica_prefix(module: nn.Module, path: CheckpointDir) -> str:
    """Where this rank's state is among the checkpoint's keys: ``replica<rank>.`` where ranks differ."""
    if not _rank_local(module):
        return ""
    rank = dist.get_rank()
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if not any(key.startswith(f"replica{rank}.") for key in saved):
        replicas = len({key.split(".")[0] for key in saved if key.startswith("replica")})
        raise OptionsError(
            f"the checkpoint at {os.fspath(path)!r} holds no state of rank {rank} ({replicas or 'no'} ranks saved "
            "theirs): a local_sgd or zero1 run resumes at the world size, and with the strategy, that saved it"
        )
    return f"replica{rank}."


def full_state_dict(model: nn.Module) -> dict[str, Any] | None:
    """The whole ``model.state_dict()`` as full CPU tensors on rank 0, ``None`` on the other ranks.

    Call it on every rank: each DTensor of ``model.state_dict()`` (shards, tensor-parallel blocks) is all-gathered,
    one at a time. The names are the original ones, so a fresh, plain model loads the result with ``load_state_dict``;
    a tied weight is gathered once and is one tensor under each of its names, as in a plain
    model's state dict.
    """
    module = _unwrap(model)
    pipelined = getattr(module, "_dpar_pipeline", None)
    if pipelined is not None:  # dpar.pipeline: each parameter lives on the rank of its stage
        return pipelined.full_state_dict()
    keep = not dist.is_initialized() or dist.get_rank() == 0
    # A tied weight is one parameter under several names: gathered once, one tensor under each name.
    owner = {name: id(t) for name, t in module.named_parameters(remove_duplicate=False)}
    owner.update({name: id(t) for name, t in module.named_buffers(remove_duplicate=False)})
    full_of: dict[int, torch.Tensor] = {}  # id(parameter, buffer or entry) -> its full CPU copy
    full: dict[str, Any] = {}
    # Sharded and tensor-parallel parameters are DTensors of their whole shape in model.state_dict(), also after
    # a module's own state-dict hooks rewrote them (torchtitan's fused QKV split into wq/wk/wv).
    for name, value in module.state_dict().items():
        if isinstance(value, torch.Tensor):
            key = owner.get(name, id(value))
            if key not in full_of:
                tensor = value.detach()
                tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                full_of[key] = tensor.to("cpu", copy=True)
            value = full_of[key]
        full[name] = value
    return full if keep else None


def _unwrap(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wraps: its names have no ``_orig_mod.`` prefix."""
    return getattr(model, "_orig_mod", model)


def _parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in its state-dict order."""
    name_of = {id(p): name for name, p in module.named_parameters()}  # a tied weight: its first name
    names = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            param = zero1.whole_of(param)  # zero1: the optimizer steps a view of this rank's range
            if id(param) not in name_of:
                raise OptionsError(
                    f"{type(optimizer).__name__} holds a parameter of shape {tuple(param.shape)} that is not "
                    "in the model: build the optimizer from model.parameters(), after dpar.parallelize"
                )
            names.append(name_of[id(param)])
    return names


def _optimizer_state_by_name(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name instead of position.

    Names keep a checkpoint valid when the optimizer lists the parameters in another order.
    The state tensors are the optimizer's own (sharded like their parameters), so DCP
    loads into them in place.
    """
    names = _parameter_names(module, optimizer)
    params = _optimizer_parameters(optimizer)
    by_position = optimizer.state_dict()
    return {
        "state": {
            names[index]: {key: _as_dtensor(value, params[index]) for key, value in state.items()}
            for index, state in by_position["state"].items()
        },
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]} for group in by_position["param_groups"]
        ],
    }


def _optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _as_dtensor(value: object, param: torch.Tensor) -> object:
    """A tensor-parallel parameter's optimizer state (a block, like it) as the DTensor of the whole: DCP writes
    each rank's block once, where a plain tensor under one name would be written once for all of them."""
    return as_dtensor(value, param) if isinstance(value, torch.Tensor) else value


def _optimizer_state_by_position(
    module: nn.Module, optimizer: torch.optim.Optimizer, by_name: dict[str, Any]
) -> dict[str, Any]:
    position = {name: index for index, name in enumerate(_parameter_names(module, optimizer))}
    params = _optimizer_parameters(optimizer)
    return {
        "state": {
            position[name]: {key: as_block(value, params[position[name]]) for key, value in state.items()}
            for name, state in by_name["state"].items()
        },
        "param_groups": [
            {**group, "params": [position[name] for name in group["params"]]} for group in by_name["param_groups"]
        ],
    }


def _saved_part(by_name: dict[str, Any], path: CheckpointDir, prefix: str = "") -> dict[str, Any]:
    """The optimizer state to read: only that of the parameters the saved optimizer had state for.

    A parameter no gradient reached (a layer the forward never reads) has no state in the
    saved run, but has some after ``_create_optimizer_state``: DCP would fail on the missing
    keys. Dropped here, it has none after ``optimizer.load_state_dict``, as when it was saved.
    """
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if not any(key.startswith(f"{prefix}optimizer.") for key in saved):
        raise OptionsError(f"the checkpoint at {os.fspath(path)!r} has no optimizer state: load it with optimizer=None")
    stepped = {
        name: param_state
        for name, param_state in by_name["state"].items()
        if any(f"{prefix}optimizer.state.{name}.{key}" in saved for key in param_state)  # DCP's flat names
    }
    return {**by_name, "state": stepped}


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors, so that DCP has tensors to load into.

    DCP loads into the tensors it is given, and a fresh optimizer's ``state_dict()`` has
    none: the moments would silently stay unloaded. An optimizer creates its state in its
    first step, with the layout of its parameters (sharded here); one step with zero
    gradients at learning rate 0 creates it without moving a parameter, as torch's
    ``set_state_dict`` does. The load overwrites the step count and moments it leaves.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for param in params:
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * 0  # a tensor learning rate stays a tensor
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, learning_rates):
        group["lr"] = lr
    for param, grad in zip(params, grads):
        param.grad = grad


__all__ = ["async_save", "full_state_dict", "load", "load_safetensors", "save", "save_safetensors"]
