"""Tensor parallel's surgery: each split parameter replaced by this rank's block, its module's class swapped.

See [Note: how a tensor-parallel parameter reaches the graph] and [Note: a split parameter in a state dict]
in runtime/tensor_parallel.py. The one import of runtime from surgery is here, one way: the class this module
installs reads each split parameter through runtime's marker op (at every forward) and writes and reads it
in state dicts through runtime's views (``as_dtensor``, ``as_block``, which checkpoints use too). Those run
while training, so they are runtime's; the runtime never imports surgery.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_parameter_registration_hook

from dpar.core import model_state
from dpar.core.errors import OptionsError
from dpar.core.facts import TENSOR_PARALLEL, TensorParallelSpec, can_split, local_block, tensor_parallel_spec_of
from dpar.core.torch_internals import frame_running, full_state_dict_loader_code
from dpar.surgery.sharding import refuse_torch_ddp
from dpar.runtime.parameter_writes import TensorParallelBlock, as_block_parameter
from dpar.runtime.tensor_parallel import as_block, as_dtensor, whole_parameter


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
# tensor and ``as_block`` cuts: nothing to do. The caller is recognized by the code of torch's private function (core/torch_internals.py): were
# it renamed, torch's own shape error comes back (tests/test_reshard.py fails on it), never wrong numbers.


def _in_torch_full_state_dict_load() -> bool:
    """Whether torch's ``set_model_state_dict`` of a full state dict is asking (see the Note above)."""
    frame = frame_running(full_state_dict_loader_code(), limit=256)  # its generators recurse once per module level
    info = None if frame is None else frame.f_locals.get("info")
    return bool(getattr(info, "full_state_dict", False) or getattr(info, "broadcast_from_rank0", False))



def _marking_class(
    cls: type[nn.Module], splits: dict[str, TensorParallelSpec], state: model_state.ModelState,
    own_forward: Callable[..., Any] | None = None,
) -> type[nn.Module]:
    """A subclass of ``cls`` whose split parameters read as marked full tensors in a forward and as their blocks
    everywhere else (see [Note: a parameter is its parameter] in core/model_state.py), and are written to (and
    read from) state dicts as DTensors of their whole shape (see [Note: a split parameter in a state dict]).

    Where ``cls`` already reads a parameter through a property (fsdp's gather
    over the data-parallel dimension), the marker wraps what that returns. With ``own_forward`` (expert
    parallel's exchange) the forward reads the blocks themselves: that forward replaces ``cls``'s, unmarked.
    """

    def marked(name: str, spec: TensorParallelSpec) -> property:
        inner = getattr(cls, name, None)

        def read(self: nn.Module) -> torch.Tensor:
            if not state.reads_whole_parameters():
                return self._parameters[name]
            block = inner.fget(self) if isinstance(inner, property) else self._parameters[name]
            return whole_parameter(block, spec)

        return property(read)

    def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
        return state.run_forward(cls.forward, self, args, kwargs)

    def _save_to_state_dict(self: nn.Module, destination: dict, prefix: str, keep_vars: bool) -> None:
        cls._save_to_state_dict(self, destination, prefix, keep_vars)
        for name in splits:
            if prefix + name in destination:
                destination[prefix + name] = as_dtensor(destination[prefix + name], self._parameters[name])

    def keep_blocks(self: nn.Module) -> None:
        """A plain block replaced by a plain parameter (``to_empty``, ``load_state_dict(assign=True)``) is held as a
        ``TensorParallelBlock`` again (see [Note: a write the part cannot take as it stands])."""
        for name in splits:
            param = self._parameters.get(name)
            if type(param) is nn.Parameter:
                self._parameters[name] = as_block_parameter(param)

    def _load_from_state_dict(self: nn.Module, state_dict: dict, prefix: str, *args: object, **kwargs: object) -> None:
        for name in splits:  # before cls's pre-hooks (fsdp's, which shards full tensors)
            if prefix + name in state_dict:
                state_dict[prefix + name] = as_block(state_dict[prefix + name], self._parameters[name])
        cls._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)
        keep_blocks(self)

    def _apply(self: nn.Module, fn: object, recurse: bool = True) -> nn.Module:
        cls._apply(self, fn, recurse)
        keep_blocks(self)
        return self

    def named_parameters(
        self: nn.Module, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        if not recurse:  # how torch DDP's constructor reads each module
            refuse_torch_ddp()
        loading = not recurse and _in_torch_full_state_dict_load()
        for name, param in cls.named_parameters(self, prefix, recurse, remove_duplicate):
            own = name[len(prefix) + 1:] if prefix else name
            if loading and own in splits and isinstance(param, DTensor):
                param = as_dtensor(param, param)  # a view: torch's in-place copy lands in the parameter
            yield name, param

    members: dict[str, object] = {name: marked(name, spec) for name, spec in splits.items()} if own_forward is None else {}
    members["named_parameters"] = named_parameters
    members["forward"] = forward if own_forward is None else own_forward
    members["_apply"] = _apply
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
                    block = TensorParallelBlock(local.clone(), param.requires_grad)
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


def state_dict_mesh(
    tp_mesh: DeviceMesh, dp_mesh: DeviceMesh | None, mesh: DeviceMesh | None, split_axis: str = "tp"
) -> DeviceMesh:
    """The mesh split parameters' state-dict DTensors live on: the tensor-parallel one, or ("tp", "dp") over the
    two existing groups of a 2-D ``mesh`` (tensor parallel first: see [Note: a split parameter in a state dict]);
    ``split_axis="ep"`` for experts split over an expert axis, ("ep", "dp")."""
    if dp_mesh is None:
        return tp_mesh
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index(split_axis), 0)
    return DeviceMesh.from_group(
        [tp_mesh.get_group(), dp_mesh.get_group()], tp_mesh.device_type, ranks, mesh_dim_names=(split_axis, "dp")
    )


def _refuse_a_tie_across_layouts(module: nn.Module, name: str, param: torch.Tensor | None) -> None:
    """``module.<name> = <another parameter of a tensor-parallel model>`` after ``parallelize`` (a weight tied late):
    kept where both are split alike (HF's ``tie_weights()`` after ``to_empty`` ties what was tied at
    ``parallelize``), refused by name where not, since one tensor cannot be two layouts' blocks."""
    current = module._parameters.get(name)
    if not isinstance(param, torch.Tensor) or current is None or current is param:
        return
    found = model_state.parameter_holding(param)
    if found is None or not found[0].facts(TENSOR_PARALLEL):
        return
    layout = lambda spec: None if spec is None or spec.dim is None else (spec.dim, tuple(spec.global_shape))
    ours, theirs = tensor_parallel_spec_of(current), tensor_parallel_spec_of(param)
    if layout(ours) != layout(theirs):
        state = found[0]
        names = state.names_of(param)
        slot = next((f"{n}.{name}" if n else name for n, m in state.model().named_modules() if m is module), name)
        raise OptionsError(
            f"{slot} tied to {names[0] if names else 'another parameter'} after dpar.parallelize, but tensor parallel "
            f"placed them differently ({_layout_words(ours)} and {_layout_words(theirs)}): one tensor cannot be both. "
            "Tie the weights before dpar.parallelize (model.tie_weights(), or the assignment itself), so that tensor "
            "parallel places them once"
        )


def _layout_words(spec: TensorParallelSpec | None) -> str:
    return "whole" if spec is None or spec.dim is None else f"split on dim {spec.dim}"


_tie_hook_installed = False  # torch's parameter-registration hooks are process-wide only: one, registered once


def install_markers(
    model: nn.Module, splits: Splits, mesh: DeviceMesh | None = None,
    own_forwards: dict[nn.Module, Callable[..., Any]] | None = None,
) -> None:
    """Swap each module's class so split parameters read as marked full tensors, and register their blocks
    (with ``mesh``, from ``state_dict_mesh``, they enter state dicts as DTensors). A module in ``own_forwards``
    (expert parallel's) reads its blocks as they are, through the forward given for it."""
    global _tie_hook_installed
    state = model_state.state_of(model, create=True)
    if not _tie_hook_installed:
        register_module_parameter_registration_hook(_refuse_a_tie_across_layouts)
        _tie_hook_installed = True
    for module, specs in splits.items():
        split = {n: s for n, s in specs.items() if s.dim is not None}
        for spec in split.values():
            state.set_fact(TENSOR_PARALLEL, spec.name, dataclasses.replace(spec, state_dict_mesh=mesh))
        if split:
            own = (own_forwards or {}).get(module)
            module.__class__ = _marking_class(type(module), split, state, own)
