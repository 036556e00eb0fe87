"""Parameters at rest as dim-0 shards (DTensor), read by a forward as full tensors.

[Note: how a sharded parameter reaches the graph]
Each parameter is replaced by an ``nn.Parameter`` holding a ``Shard(0)`` DTensor,
so ``model.parameters()``, optimizers (whose state is then sharded too),
``state_dict`` and ``torch.distributed.checkpoint`` all see shards. The module's
class is swapped for a subclass whose attribute of the same name returns the shard
redistributed to ``Replicate()`` and read by ``to_local(grad_placements=[Partial()])``
(what ``shard.full_tensor(grad_placements=...)`` does, spelled so that torch 2.11's
Dynamo traces it: it graph-breaks on ``full_tensor``'s own autograd.Function and
its list of placements, splitting every sharded module into frames dpar cannot
pair with the parameters; 2.13 traces both spellings into the same graph): Dynamo and AOTAutograd trace
that into an ``all_gather_into_tensor`` in the forward and, for its gradient, a
``reduce_scatter_tensor`` in the backward. dpar's passes then own what happens
to those collectives: buckets, averaging, prefetch order and whether the
gathered parameter is kept for the backward (zero2) or gathered again (fsdp).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dpar.core import model_state
from dpar.core.errors import LEAVE_DDP_OUT, OptionsError, WrappedTwiceError
from dpar.core.facts import SHARD, ShardSpec, retire
from dpar.core.torch_internals import inside_ddp_constructor

_BLOCK = re.compile(r"^((?:.*?\.)??\d+)\.")


def block_of(name: str) -> str:
    """``layers.3.attn.q.weight`` -> ``layers.3``, ``3.weight`` (an ``nn.Sequential`` root) -> ``3``;
    parameters outside a numbered block -> ``root``."""
    match = _BLOCK.match(name)
    return match.group(1) if match else "root"


def refuse_torch_ddp() -> None:
    """Refuse torch DDP's constructor reading a parallelized module's parameters (Hugging Face's plain ``Trainer``
    wraps the model so under torchrun): it would broadcast rank 0's parts over every rank's, then reduce every
    gradient a second time (see [Note: wrapped twice] in compiler/wrapped_twice.py)."""
    if inside_ddp_constructor():
        raise WrappedTwiceError(
            "a model dpar.parallelize placed is being wrapped in torch.nn.parallel.DistributedDataParallel: "
            + LEAVE_DDP_OUT
        )


def _gathering_class(
    cls: type[nn.Module], names: list[str], param_dtype: torch.dtype | None, state: model_state.ModelState
) -> type[nn.Module]:
    """A subclass of ``cls`` whose parameter attributes read the gathered full tensors in a forward, and the
    shards everywhere else (see [Note: a parameter is its parameter] in core/model_state.py).

    With ``param_dtype`` the shard is cast before the gather (so the gather moves
    the smaller dtype), and floating-point inputs of the module are cast too, as
    FSDP2's MixedPrecisionPolicy does, so compute runs in ``param_dtype``.
    """

    def full(name: str) -> property:
        def read(self: nn.Module) -> torch.Tensor:
            shard = self._parameters[name]
            if not state.reads_whole_parameters():
                return shard
            if param_dtype is not None:
                shard = shard.to(param_dtype)
            ndim = shard.device_mesh.ndim
            return shard.redistribute(placements=[Replicate()] * ndim, async_op=False).to_local(
                grad_placements=[Partial()] * ndim)

        return property(read)

    def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
        if param_dtype is not None:
            cast = lambda v: v.to(param_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            args, kwargs = tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}
        return state.run_forward(cls.forward, self, args, kwargs)

    def named_parameters(
        self: nn.Module, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        if not recurse:  # how torch DDP's constructor reads each module
            refuse_torch_ddp()
        return cls.named_parameters(self, prefix, recurse, remove_duplicate)

    members: dict[str, object] = {n: full(n) for n in names}
    members["forward"] = forward
    members["named_parameters"] = named_parameters
    return type(f"Sharded{cls.__name__}", (cls,), members)


def shard_parameters(
    model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
    meshes: dict[str, DeviceMesh] | None = None,
) -> list[ShardSpec]:
    """Replace every parameter of ``model`` by its dim-0 shard over ``mesh`` (or over ``meshes[name]``: under
    fsdp+ep the experts' blocks over "dp", the rest over every rank), in place."""
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:  # refuse before anything is replaced
        raise OptionsError(
            f"parameter {scalars[0]} is a scalar, which cannot be sharded on dim 0; "
            "give it shape [1] or keep the model unsharded"
        )
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
            over = (meshes or {}).get(qualified, mesh)
            # 1-D: shard over the mesh. 2-D (hsdp): replicate over dim 0, shard over dim 1.
            placements = [Shard(0)] if over.ndim == 1 else [Replicate(), Shard(0)]
            shard = nn.Parameter(
                distribute_tensor(full.detach(), over, placements), requires_grad=full.requires_grad
            )
            spec = ShardSpec(name=qualified, global_shape=tuple(full.shape))
            module._parameters[name] = shard_of[id(full)] = shard
            state.set_fact(SHARD, qualified, spec)
            retire(state, qualified, full)
            specs.append(spec)
        module.__class__ = _gathering_class(type(module), names, param_dtype, state)
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
    return state is not None and bool(state.facts(SHARD))
