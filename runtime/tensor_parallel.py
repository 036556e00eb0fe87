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
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils.weak import WeakIdKeyDictionary

from dpar.runtime.errors import OptionsError


@dataclasses.dataclass(frozen=True)
class TensorParallelSpec:
    """How one parameter is split over the tensor-parallel group (``dim`` None: replicated), as the
    runtime's gather of its blocks needs it; the model-wide choices are its plan's."""

    name: str
    dim: int | None
    global_shape: tuple[int, ...]
    group_name: str
    tp_size: int


_specs: WeakIdKeyDictionary = WeakIdKeyDictionary()


def tensor_parallel_spec_of(param: torch.Tensor) -> TensorParallelSpec | None:
    return _specs.get(param)


def gather_blocks(block: torch.Tensor, spec: TensorParallelSpec) -> torch.Tensor:
    """The full parameter from every rank's block (call on every rank of the group)."""
    return tensor_parallel_weight(
        block.detach(), spec.dim, spec.tp_size, spec.group_name, spec.global_shape[spec.dim], spec.name
    )


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


def _marking_class(cls: type[nn.Module], splits: dict[str, TensorParallelSpec]) -> type[nn.Module]:
    """A subclass of ``cls`` whose split parameters read as marked full tensors.

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

    members = {name: marked(name, spec) for name, spec in splits.items()}
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


def install_markers(splits: Splits) -> None:
    """Swap each module's class so split parameters read as marked full tensors, and register their blocks."""
    for module, specs in splits.items():
        split = {n: s for n, s in specs.items() if s.dim is not None}
        for pname, spec in split.items():
            _specs[module._parameters[pname]] = spec
        if split:
            module.__class__ = _marking_class(type(module), split)
