"""The tensor-parallel marker ops a forward reads split parameters through, and their state-dict views.

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

The parameters are split and the modules' classes swapped once, at ``parallelize``
(surgery/tensor_parallel.py); the marker ops and the views below run while training.

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

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dpar.core.facts import TensorParallelSpec, local_block, tensor_parallel_spec_of
from dpar.core.torch_internals import resolve_process_group


@torch.library.custom_op("dpar::tensor_parallel_weight", mutates_args=())
def tensor_parallel_weight(
    block: torch.Tensor, dim: int, tp_size: int, group_name: str, size: int, name: str = ""
) -> torch.Tensor:
    """The full parameter (``size`` units along ``dim``) from this rank's block: an all-gather when run
    eagerly, each block padded to the longest one first. ``name`` (the parameter's) is for messages."""
    group = resolve_process_group(group_name)
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


def whole_parameter(block: torch.Tensor, spec: TensorParallelSpec) -> torch.Tensor:
    """The full parameter ``spec`` describes, read from this rank's ``block`` through the marker (traced: the
    tensor-parallel passes' input; eager: an all-gather over the spec's group)."""
    return tensor_parallel_weight(block, spec.dim, spec.tp_size, spec.group_name, spec.global_shape[spec.dim], spec.name)


@torch.library.custom_op("dpar::tensor_parallel_grad", mutates_args=())
def tensor_parallel_grad(grad: torch.Tensor, dim: int, tp_size: int, group_name: str) -> torch.Tensor:
    """This rank's block of a full gradient every rank of the group computed alike."""
    rank = dist.get_rank(resolve_process_group(group_name))
    # A copy, not .contiguous(): at one rank the block is the whole gradient, and a custom op may not
    # return its own input (run uncompiled, as it is without a process group, that raised).
    return grad.narrow(dim, *local_block(grad.shape[dim], tp_size, rank)).clone(memory_format=torch.contiguous_format)


@tensor_parallel_grad.register_fake
def _(grad: torch.Tensor, dim: int, tp_size: int, group_name: str) -> torch.Tensor:
    rank = dist.get_rank(resolve_process_group(group_name))
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
