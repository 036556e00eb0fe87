"""Parameters split over a tensor-parallel mesh dimension, read by the forward as marked full tensors.

[Note: how a tensor-parallel parameter reaches the graph]
A parameter that tensor parallel splits (a column or row block of a Linear
weight, a range of embedding rows) is replaced by its local block. The module
attribute the forward reads returns ``dpar::tensor_parallel_weight(block)``, an
op whose value has the *full* shape, so Dynamo and AOTAutograd trace the
single-device program unchanged: every shape in the joint graph is global. Its
gradient goes through ``dpar::tensor_parallel_grad``. The tensor-parallel pass
(``compiler/passes/tensor_parallel.py``) seeds sharding propagation from these
markers, rewrites the graph to run on local blocks with the collectives it
needs, and removes the markers. Run eagerly (never compiled) the markers do
what they say, an all-gather and a local slice, so the numbers stay right.

With fsdp+tp the block is itself the "full" tensor of an fsdp shard over the
data-parallel dimension: ``tensor_parallel_weight(shard.full_tensor())``.

[Note: a split parameter in a state dict]
The block sits in ``module._parameters`` under the parameter's name, so a plain
``state_dict`` would hold one rank's block with nothing saying so (``torch.save``
on rank 0 wrote half a model, DCP one block for every rank's). The marking class
therefore writes each split parameter as a DTensor of its global shape whose
local part is the block, no copy and no collective: ``Shard(dim)`` over the
tensor-parallel mesh dimension, uneven blocks as ``torch.chunk`` cuts them (the
layout of ``local_block``), which is torch's own TP convention and what DCP
reads. Under zero2/fsdp+tp the block is itself sharded on dim 0 over the data
dimension, tensor parallel first: the DTensor lives on a ("tp", "dp") mesh built
from the two existing groups, where ``[Shard(dim), Shard(0)]`` read left to right
is that nesting exactly, even when dim is 0 and the sizes are uneven (on the
("dp", "tp") order it would take ``_StridedShard``, whose uneven splits differ).
Under ddp+tp the data dimension is ``Replicate()``. Hooks that rewrite a state
dict (torchtitan's fused QKV splits ``wqkv`` into ``wq``/``wk``/``wv``) then see
the global tensor and redistribute it themselves. ``load_state_dict`` takes such
DTensors back, or DTensors of any other layout, or plain full tensors, which each
rank cuts to its own block (no collective: every rank passes the full tensor).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Replicate, Shard
from dpar.core import model_state
from dpar.core.errors import OptionsError


@dataclasses.dataclass(frozen=True)
class TensorParallelSpec:
    """How one parameter is split over the tensor-parallel group (``dim`` None: replicated), as the
    runtime's gather of its blocks needs it; the model-wide choices are its plan's."""

    name: str
    dim: int | None
    global_shape: tuple[int, ...]
    group_name: str
    tp_size: int
    # The mesh its state-dict DTensor lives on (``state_dict_mesh``), set when its marker is installed.
    state_dict_mesh: DeviceMesh | None = dataclasses.field(default=None, compare=False)


_KIND = "tensor_parallel"  # TensorParallelSpec facts of split parameters in the model's ModelState


def tensor_parallel_spec_of(param: torch.Tensor) -> TensorParallelSpec | None:
    return model_state.fact_of(_KIND, param)


def local_block(size: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s block of ``size`` units split over ``tp_size`` ranks.

    Blocks are ``ceil(size / tp_size)`` long and the last one takes what is left
    (torch.chunk's and DTensor's layout), so a vocabulary of 50257 splits over 4
    ranks without padding the model: padding lives only inside the collectives.
    """
    block = -(-size // tp_size)
    start = min(rank * block, size)
    return start, min(block, size - start)


def can_split(size: int, tp_size: int) -> bool:
    """Whether every rank gets a non-empty block of ``size`` units."""
    return (tp_size - 1) * -(-size // tp_size) < size


@torch.library.custom_op("dpar::tensor_parallel_weight", mutates_args=())
def tensor_parallel_weight(
    block: torch.Tensor, dim: int, tp_size: int, group_name: str, size: int, name: str = ""
) -> torch.Tensor:
    """The full parameter (``size`` units along ``dim``) from this rank's block: an all-gather when run
    eagerly, each block padded to the longest one first. ``name`` (the parameter's) is for messages."""
    group = _resolve_process_group(group_name)
    longest = local_block(size, tp_size, 0)[1]
    padded = torch.nn.functional.pad(block.movedim(dim, -1), (0, longest - block.shape[dim])).movedim(-1, dim)
    blocks = [torch.empty_like(padded) for _ in range(tp_size)]
    dist.all_gather(blocks, padded.contiguous(), group=group)
    return torch.cat(blocks, dim).narrow(dim, 0, size)


@tensor_parallel_weight.register_fake
def _(block: torch.Tensor, dim: int, tp_size: int, group_name: str, size: int, name: str = "") -> torch.Tensor:
    shape = list(block.shape)
    shape[dim] = size
    return block.new_empty(shape)


@torch.library.custom_op("dpar::tensor_parallel_grad", mutates_args=())
def tensor_parallel_grad(grad: torch.Tensor, dim: int, tp_size: int, group_name: str) -> torch.Tensor:
    """This rank's block of a full gradient every rank of the group computed alike."""
    rank = dist.get_rank(_resolve_process_group(group_name))
    # A copy, not .contiguous(): at one rank the block is the whole gradient, and a custom op may not
    # return its own input (run uncompiled, as it is without a process group, that raised).
    return grad.narrow(dim, *local_block(grad.shape[dim], tp_size, rank)).clone(memory_format=torch.contiguous_format)


@tensor_parallel_grad.register_fake
def _(grad: torch.Tensor, dim: int, tp_size: int, group_name: str) -> torch.Tensor:
    rank = dist.get_rank(_resolve_process_group(group_name))
    shape = list(grad.shape)
    shape[dim] = local_block(shape[dim], tp_size, rank)[1]
    return grad.new_empty(shape)


def _backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
    return tensor_parallel_grad(grad, ctx.dim, ctx.tp_size, ctx.group_name), None, None, None, None, None


def _setup(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    _, ctx.dim, ctx.tp_size, ctx.group_name, *_ = inputs


tensor_parallel_weight.register_autograd(_backward, setup_context=_setup)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _placements(spec: TensorParallelSpec, mesh: DeviceMesh) -> list[object]:
    """Mesh dim 0 is tensor parallel; a second one ("dp") shards dim 0 of the block (zero2/fsdp+tp) or replicates it."""
    return [Shard(spec.dim)] + [Replicate()] * (mesh.ndim - 1)


def as_dtensor(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (``param``'s block or a tensor shaped like it: its optimizer state) as the DTensor of the whole
    parameter whose local part it is; ``value`` itself for a parameter tensor parallel does not split.

    See [Note: a split parameter in a state dict]. The DTensor is a view of ``value``: DCP loads into it in place.
    """
    spec = tensor_parallel_spec_of(param)
    if spec is None or spec.state_dict_mesh is None or spec.dim is None or value.shape != param.shape:
        return value
    mesh = spec.state_dict_mesh
    placements = _placements(spec, mesh)
    if isinstance(value, DTensor):  # zero2/fsdp+tp: the block's Shard(0) over the data-parallel mesh
        placements[1] = Shard(0)
        value = value.to_local()
    return DTensor.from_local(
        value, mesh, placements, run_check=False, shape=torch.Size(spec.global_shape),
        stride=_contiguous_strides(spec.global_shape),
    )


def as_block(value: object, param: torch.Tensor) -> object:
    """What ``param`` loads from ``value``: the inverse of ``as_dtensor``, and for a DTensor of another layout
    or a plain full tensor, this rank's block of it (as a Shard(0) DTensor over the data-parallel mesh where
    ``param`` is one); anything else is left for ``load_state_dict`` to judge."""
    spec = tensor_parallel_spec_of(param)
    if spec is None or spec.state_dict_mesh is None or spec.dim is None or not isinstance(value, torch.Tensor):
        return value
    mesh = spec.state_dict_mesh
    if tuple(value.shape) != spec.global_shape:
        return value  # load_state_dict names the mismatch (or strict=False skips it)
    sharded = isinstance(param, DTensor)
    expected = _placements(spec, mesh)
    if sharded:
        expected[1] = Shard(0)
    if isinstance(value, DTensor) and value.device_mesh == mesh and list(value.placements) == expected:
        local = value.to_local()
    else:
        full = value.full_tensor() if isinstance(value, DTensor) else value
        rank = mesh.get_coordinate()
        local = full.narrow(spec.dim, *local_block(full.shape[spec.dim], spec.tp_size, rank[0]))
        if sharded:
            local = local.narrow(0, *local_block(local.shape[0], mesh.size(1), rank[1]))
    if not sharded:
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


# [Note: a 2-D parameter in torch's full-state-dict load]
# torch's ``set_model_state_dict(full_state_dict=True[, broadcast_from_rank0=True])`` does not load through
# ``model.state_dict()``: it takes each module's ``named_parameters(recurse=False)`` as the local state and, for
# a DTensor there, copies into its local tensor the slice of the full tensor that the DTensor's own mesh and
# placements describe (``_distribute_tensors``), before ``load_state_dict`` runs. Under zero2/fsdp+tp the
# DTensor in ``module._parameters`` is the data-parallel ``Shard(0)`` of this rank's tensor-parallel block, a
# DTensor whose "whole" is the block, not the parameter: torch cut the full tensor by data-parallel rank alone
# (rows 0-15 of a (32, 32) weight for a (8, 32) shard), failed on the shape, and left the parameters before
# the failing one loaded. The parameter must stay that DTensor (fsdp's gather reads it whole over "dp" and the
# tensor-parallel marker takes the block from there), and the same loop serves torch's
# ``get_optimizer_state_dict``, which keys the optimizer's state by the very parameter objects. So only while
# torch's ``_load_model_state_dict`` asks for the parameters of a full state dict, the marking class answers
# with the parameter as ``model.state_dict()`` describes it (``as_dtensor``: [Shard(dim), Shard(0)] over
# ("tp", "dp"), whole shape), a view of the same memory: torch's slice is then this rank's block of its data
# shard, copied in place, and ``load_state_dict`` takes the view back unchanged (``as_block``); into parameters
# still on meta, torch builds new DTensors from the view's layout and assigns them, ``as_block`` again turning
# each into the data-parallel shard. Plain tp and ddp+tp hold plain blocks, which torch replaces by the full
# tensor and ``as_block`` cuts: nothing to do. The caller is recognized by torch's private function name: were
# it renamed, torch's own shape error comes back (tests/test_reshard.py fails on it), never wrong numbers.


def _in_torch_full_state_dict_load() -> bool:
    """Whether torch's ``set_model_state_dict`` of a full state dict is asking (see the Note above)."""
    frame = sys._getframe(1)
    for _ in range(256):  # its generators recurse once per module level
        if frame is None:
            return False
        if frame.f_code.co_name == "_load_model_state_dict" and frame.f_globals.get("__name__") == _TORCH_STATE_DICT:
            info = frame.f_locals.get("info")
            return bool(getattr(info, "full_state_dict", False) or getattr(info, "broadcast_from_rank0", False))
        frame = frame.f_back
    return False


_TORCH_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def _marking_class(cls: type[nn.Module], splits: dict[str, TensorParallelSpec]) -> type[nn.Module]:
    """A subclass of ``cls`` whose split parameters read as marked full tensors, and are written to (and read
    from) state dicts as DTensors of their whole shape (see [Note: a split parameter in a state dict]).

    Where ``cls`` already reads a parameter through a property (fsdp's gather
    over the data-parallel dimension), the marker wraps what that returns.
    """

    def marked(name: str, spec: TensorParallelSpec) -> property:
        inner = getattr(cls, name, None)

        def read(self: nn.Module) -> torch.Tensor:
            block = inner.fget(self) if isinstance(inner, property) else self._parameters[name]
            return tensor_parallel_weight(
                block, spec.dim, spec.tp_size, spec.group_name, spec.global_shape[spec.dim], spec.name
            )

        return property(read)

    def _save_to_state_dict(self: nn.Module, destination: dict, prefix: str, keep_vars: bool) -> None:
        cls._save_to_state_dict(self, destination, prefix, keep_vars)
        for name in splits:
            if prefix + name in destination:
                destination[prefix + name] = as_dtensor(destination[prefix + name], self._parameters[name])

    def _load_from_state_dict(self: nn.Module, state_dict: dict, prefix: str, *args: object, **kwargs: object) -> None:
        for name in splits:  # before cls's pre-hooks (fsdp's, which shards full tensors)
            if prefix + name in state_dict:
                state_dict[prefix + name] = as_block(state_dict[prefix + name], self._parameters[name])
        cls._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)

    def named_parameters(
        self: nn.Module, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        loading = not recurse and _in_torch_full_state_dict_load()
        for name, param in cls.named_parameters(self, prefix, recurse, remove_duplicate):
            own = name[len(prefix) + 1:] if prefix else name
            if loading and own in splits and isinstance(param, DTensor):
                param = as_dtensor(param, param)  # a view: torch's in-place copy lands in the parameter
            yield name, param

    members: dict[str, object] = {name: marked(name, spec) for name, spec in splits.items()}
    members["named_parameters"] = named_parameters
    members["_save_to_state_dict"] = _save_to_state_dict
    members["_load_from_state_dict"] = _load_from_state_dict
    return type(f"TensorParallel{cls.__name__}", (cls,), members)


Splits = dict[nn.Module, dict[str, TensorParallelSpec]]


def split_parameters(
    model: nn.Module,
    tp_dims: dict[str, int | None],
    group: dist.ProcessGroup,
) -> Splits:
    """Replace each parameter that ``tp_dims`` splits by this rank's block, in place.

    Rank 0's values are broadcast first, so blocks of one parameter fit together.
    Call ``install_markers`` afterwards (after fsdp sharding, if any).
    """
    tp_size, rank = dist.get_world_size(group), dist.get_rank(group)
    named = dict(model.named_parameters(remove_duplicate=False))
    for name, dim in tp_dims.items():
        if name not in named:
            raise OptionsError(f"the tensor-parallel plan names {name!r}, which is not a parameter of the model")
        if dim is not None and not can_split(named[name].shape[dim], tp_size):
            raise OptionsError(
                f"tensor parallel degree {tp_size} leaves some ranks no part of dimension {dim} of {name} "
                f"(shape {tuple(named[name].shape)}); choose a degree of at most "
                f"{named[name].shape[dim]} that gives every rank a block, or keep {name} replicated (tp dim None)"
            )
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_meta:  # a model born on meta gets its values after to_empty, on every rank alike
                dist.broadcast(param.data, src=0)
    splits: Splits = {}
    block_of: dict[int, tuple[nn.Parameter, TensorParallelSpec]] = {}  # tied weights: one block
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            qualified = f"{module_name}.{pname}" if module_name else pname
            if id(param) not in block_of:
                dim = tp_dims.get(qualified)
                spec = TensorParallelSpec(qualified, dim, tuple(param.shape), group.group_name, tp_size)
                block = param
                if dim is not None:
                    local = param.detach().narrow(dim, *local_block(param.shape[dim], tp_size, rank))
                    block = nn.Parameter(local.clone(), param.requires_grad)
                block_of[id(param)] = (block, spec)
            block, spec = block_of[id(param)]
            if tp_dims.get(qualified, spec.dim) != spec.dim:
                raise OptionsError(
                    f"{qualified} is tied to {spec.name} but the plan splits them differently "
                    f"(dims {tp_dims[qualified]} and {spec.dim}); tied parameters need one placement"
                )
            module._parameters[pname] = block
            splits.setdefault(module, {})[pname] = spec
    return splits


def state_dict_mesh(tp_mesh: DeviceMesh, dp_mesh: DeviceMesh | None, mesh: DeviceMesh | None) -> DeviceMesh:
    """The mesh split parameters' state-dict DTensors live on: the tensor-parallel one, or ("tp", "dp") over the
    two existing groups of a 2-D ``mesh`` (tensor parallel first: see [Note: a split parameter in a state dict])."""
    if dp_mesh is None:
        return tp_mesh
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("tp"), 0)
    return DeviceMesh.from_group(
        [tp_mesh.get_group(), dp_mesh.get_group()], tp_mesh.device_type, ranks, mesh_dim_names=("tp", "dp")
    )


def install_markers(model: nn.Module, splits: Splits, mesh: DeviceMesh | None = None) -> None:
    """Swap each module's class so split parameters read as marked full tensors, and register their blocks
    (with ``mesh``, from ``state_dict_mesh``, they enter state dicts as DTensors)."""
    state = model_state.state_of(model, create=True)
    for module, specs in splits.items():
        split = {n: s for n, s in specs.items() if s.dim is not None}
        for spec in split.values():
            state.set_fact(_KIND, spec.name, dataclasses.replace(spec, state_dict_mesh=mesh))
        if split:
            module.__class__ = _marking_class(type(module), split)
