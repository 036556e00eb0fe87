"""Parameters at rest as dim-0 shards (DTensor), read by the forward as full tensors.

[Note: how a sharded parameter reaches the graph]
Each parameter is replaced by an ``nn.Parameter`` holding a ``Shard(0)`` DTensor,
so ``model.parameters()``, optimizers (whose state is then sharded too),
``state_dict`` and ``torch.distributed.checkpoint`` all see shards. The module's
class is swapped for a subclass whose attribute of the same name returns
``shard.full_tensor(grad_placements=[Partial()])``: Dynamo and AOTAutograd trace
that into an ``all_gather_into_tensor`` in the forward and, for its gradient, a
``reduce_scatter_tensor`` in the backward. dpar's passes then own what happens
to those collectives: buckets, averaging, prefetch order and whether the
gathered parameter is kept for the backward (zero2) or gathered again (fsdp).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._collective_utils import pad_tensor
from torch.utils.weak import WeakIdKeyDictionary

from dpar.core import model_state
from dpar.core.errors import OptionsError


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """One parameter's facts; how the model as a whole is sharded is its plan's (``core/plan.py``)."""

    name: str
    global_shape: tuple[int, ...]


# Full parameters replaced by shards: no longer in any model, so this table never holds a parameter that
# to_empty or load_state_dict could swap (see [Note: facts keyed by name, not by tensor]).
_retired: WeakIdKeyDictionary = WeakIdKeyDictionary()
_KIND = "shard"  # ShardSpec facts in the model's ModelState

_BLOCK = re.compile(r"^((?:.*?\.)??\d+)\.")


def block_of(name: str) -> str:
    """``layers.3.attn.q.weight`` -> ``layers.3``, ``3.weight`` (an ``nn.Sequential`` root) -> ``3``;
    parameters outside a numbered block -> ``root``."""
    match = _BLOCK.match(name)
    return match.group(1) if match else "root"


def spec_of(param: torch.Tensor) -> ShardSpec | None:
    return model_state.fact_of(_KIND, param)


def is_retired(param: torch.Tensor) -> bool:
    return param in _retired


def _gathering_class(
    cls: type[nn.Module], names: list[str], param_dtype: torch.dtype | None
) -> type[nn.Module]:
    """A subclass of ``cls`` whose parameter attributes read the gathered full tensors.

    With ``param_dtype`` the shard is cast before the gather (so the gather moves
    the smaller dtype), and floating-point inputs of the module are cast too, as
    FSDP2's MixedPrecisionPolicy does, so compute runs in ``param_dtype``.
    """

    def full(name: str) -> property:
        def read(self: nn.Module) -> torch.Tensor:
            shard = self._parameters[name]
            if param_dtype is not None:
                shard = shard.to(param_dtype)
            return shard.full_tensor(grad_placements=[Partial()] * shard.device_mesh.ndim)

        return property(read)

    members: dict[str, object] = {n: full(n) for n in names}
    if param_dtype is not None:

        def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
            cast = lambda v: v.to(param_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            return cls.forward(self, *map(cast, args), **{k: cast(v) for k, v in kwargs.items()})

        members["forward"] = forward
    return type(f"Sharded{cls.__name__}", (cls,), members)


def shard_parameters(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None) -> list[ShardSpec]:
    """Replace every parameter of ``model`` by its dim-0 shard over ``mesh``, in place."""
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:  # refuse before anything is replaced
        raise OptionsError(
            f"parameter {scalars[0]} is a scalar, which cannot be sharded on dim 0; "
            "give it shape [1] or keep the model unsharded"
        )
    # 1-D: shard over the mesh. 2-D (hsdp): replicate over dim 0, shard over dim 1.
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    specs = []
    state = model_state.state_of(model, create=True)
    shard_of: dict[int, nn.Parameter] = {}  # tied weights: one shard, read by every owner
    for module_name, module in model.named_modules(remove_duplicate=False):
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        for name in names:
            full = module._parameters[name]
            if id(full) in shard_of:
                module._parameters[name] = shard_of[id(full)]
                continue
            qualified = f"{module_name}.{name}" if module_name else name
            shard = nn.Parameter(
                distribute_tensor(full.detach(), mesh, placements), requires_grad=full.requires_grad
            )
            spec = ShardSpec(name=qualified, global_shape=tuple(full.shape))
            module._parameters[name] = shard_of[id(full)] = shard
            state.set_fact(_KIND, qualified, spec)
            _retired[full] = True
            specs.append(spec)
        module.__class__ = _gathering_class(type(module), names, param_dtype)
        module.register_load_state_dict_pre_hook(functools.partial(_shard_full_tensors, names=names))
    return specs


def _shard_full_tensors(
    module: nn.Module, state_dict: dict[str, object], prefix: str, *args: object, names: list[str]
) -> None:
    """``load_state_dict`` of a plain (full) state dict: shard each full tensor as its parameter is.

    Every rank loads, as every rank holds shards; rank 0's values are scattered.
    """
    for name in names:
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            shard = module._parameters[name]
            full = value.to(device=shard.device, dtype=shard.dtype)
            state_dict[prefix + name] = distribute_tensor(full, shard.device_mesh, shard.placements)


def is_sharded(model: nn.Module) -> bool:
    state = model_state.state_of(model)
    return state is not None and bool(state.facts(_KIND))


_guard_installed = False


def _refuse_retired_parameters(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    for group in optimizer.param_groups:
        if any(is_retired(p) for p in group["params"]):
            raise OptionsError(
                f"this {type(optimizer).__name__} was built before dpar.parallelize, so it holds the "
                "full parameters that parallelize replaced by shards (their gradients never come): "
                "build the optimizer after parallelize, from model.parameters()"
            )


def guard_optimizers_built_too_early() -> None:
    """From now on, an optimizer step over replaced full parameters fails instead of doing nothing."""
    global _guard_installed
    if not _guard_installed:
        register_optimizer_step_pre_hook(_refuse_retired_parameters)
        _guard_installed = True


# [Note: uneven shards, one pad]
# DTensor's ``Shard(0)`` follows ``torch.chunk``: with d0 rows over N ranks the
# last ranks get fewer rows, or none. To reduce-scatter such a gradient
# (``Shard._reduce_shard_tensor``) DTensor splits the full tensor into N chunks,
# pads each to ``ceil(d0 / N)`` rows and concatenates them: 2N + 1 traced ops per
# parameter, tens of thousands of nodes at the N = 1024 ``dpar inspect`` simulates.
# Padding the whole tensor once at its end gives the same buffer (the chunks are
# consecutive row ranges, and only the last non-empty one and the empty ones are
# short), so the same reduce-scatter and the same shard. dpar's backend traces its
# graphs this way, at 2 ranks as at 1024, so what ``explain`` reports is the
# program that trains. Shards at rest keep DTensor's layout (and so the optimizer
# state and checkpoints theirs).


@contextlib.contextmanager
def uneven_shards_padded_once() -> Iterator[None]:
    """While graphs are traced inside the block, an uneven ``Shard`` is reduce-scattered after one pad."""
    per_chunk = Shard._reduce_shard_tensor

    def reduce_shard_tensor(
        self: Shard, tensor: torch.Tensor, mesh: DeviceMesh, reduce_op: str, mesh_dim: int
    ) -> torch.Tensor:
        size, ranks, coordinate = tensor.size(self.dim), mesh.size(mesh_dim), mesh.get_coordinate()
        if size % ranks == 0 or coordinate is None:
            return per_chunk(self, tensor, mesh, reduce_op, mesh_dim)
        chunk = -(-size // ranks)
        padded = pad_tensor(tensor, self.dim, chunk * ranks - size).contiguous()
        shard = funcol.reduce_scatter_single(padded, reduce_op, scatter_dim=self.dim, group=(mesh, mesh_dim))
        rows = max(0, min(chunk, size - coordinate[mesh_dim] * chunk))
        return shard if rows == chunk else shard.narrow(self.dim, 0, rows)

    Shard._reduce_shard_tensor = reduce_shard_tensor
    try:
        yield
    finally:
        Shard._reduce_shard_tensor = per_chunk
