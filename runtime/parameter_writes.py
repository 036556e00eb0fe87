"""A write into a parallelized parameter outside a forward acts as it would on the whole parameter.

[Note: a write the part cannot take as it stands]
Outside a forward ``module.weight`` is the parameter itself, this rank's part of it (see [Note: a parameter is
its parameter] in core/model_state.py). Most writes act on the part exactly as on the whole: ``fill_``,
``zero_``, ``mul_`` by a number, ``requires_grad_``. Two do not. A random draw (``normal_``, ``uniform_``, and
so every ``nn.init`` function that draws) on a part draws part-sized numbers from the generator, the same on
every rank: every rank's shard would repeat one block and none matches one device. And ``copy_`` of a plain
tensor of the parameter's whole shape into its part is refused by DTensor ("mixed torch.Tensor and DTensor").
For a parameter held as a DTensor (fsdp, zero2, hsdp and their ``+tp`` forms) both are replayed at full size:
every rank makes the whole parameter's tensor, runs the op on it (the same draw from the same generator as one
device, which every rank has seeded alike) or copies the source into it (broadcast as ``copy_`` broadcasts),
and keeps its own part (its tensor-parallel block, then its shard). No collective is issued: a write on one
rank alone stays on that rank, as it would under DDP. DTensor has no public hook for one op, so the replay is
registered in its op table (core/torch_internals.py, ``dtensor_op_handlers``) for those ops only, and acts only
on a tensor whose memory is a parallelized parameter's (``model_state.parameter_holding``); any other DTensor
gets torch's own behaviour. A tensor-parallel block held as a plain tensor (tp, ddp+tp) has no op table: it is
held as a ``TensorParallelBlock``, an ``nn.Parameter`` whose ``__torch_function__`` replays the same writes (and
every ``nn.init`` function, which hands itself to ``__torch_function__`` whole, so fan-in and fan-out are the
whole parameter's) and hands every other function to torch unchanged, its results plain tensors: Dynamo and
AOTAutograd trace it as they trace a parameter (the graphs are the same), and ``.data`` of it is a block too, so
``block.data.uniform_()`` is replayed. A ``copy_`` of a tensor of the block's own shape stays a local copy (dpar's
loaders write blocks so).

What neither can replay is an ``nn.init`` function that reads the tensor's shape without handing itself over
(``xavier_*``, ``kaiming_normal_``, ``orthogonal_``, ``sparse_``, ``eye_``, ``dirac_``; and ``kaiming_uniform_``
on a DTensor): on a part whose shape is not the whole's (a block, the shard of a block) its fan-in is the part's,
and ``orthogonal_`` of a shard would orthogonalize a gathered copy. When a write or a read of a parallelized
parameter comes from inside such a function (the outermost ``torch.nn.init`` frame and its ``tensor`` argument),
it is refused by name before anything is written: the module's own initializer and ``dpar.init_weights`` run it
on the whole parameter.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dpar.core import model_state
from dpar.core.errors import OptionsError
from dpar.core.facts import local_block, tensor_parallel_spec_of
from dpar.core.torch_internals import (
    OpOverload, compute_local_shape_and_global_offset, detect_fake_mode, dtensor_op_handlers, foreach_devices,
    resolve_process_group,
    torch_function_of_subclasses_disabled,
)

aten = torch.ops.aten
RANDOM_IN_PLACE = (
    aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor,
    aten.exponential_.default, aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default,
    aten.random_.default, getattr(aten.random_, "from"), aten.random_.to,
)


def whole_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole parameter ``param`` is a part of (a tensor-parallel block's, or a shard's)."""
    spec = tensor_parallel_spec_of(param)
    return torch.Size(spec.global_shape) if spec is not None and spec.dim is not None else param.shape


def write_part(full: torch.Tensor, param: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` (the whole parameter) into ``param`` in place; no collective."""
    spec = tensor_parallel_spec_of(param)
    part = full.detach()
    if spec is not None and spec.dim is not None:
        rank = dist.get_rank(resolve_process_group(spec.group_name))
        part = part.narrow(spec.dim, *local_block(part.shape[spec.dim], spec.tp_size, rank))
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(part.shape, param.device_mesh, param.placements)
        for dim, (length, start) in enumerate(zip(shape, offset)):
            part = part.narrow(dim, start, length)
        target = param._local_tensor
    else:
        target = param.detach()  # shares the version counter: the write counts as one (model_state's guard)
    target.copy_(part.to(dtype=target.dtype, device=target.device))


def _torch_default(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What DTensor does with ``op`` without dpar's entry (re-entered with the entry lifted for the call)."""
    handlers = dtensor_op_handlers()
    own = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = own


def _holder(target: Any) -> torch.Tensor | None:
    """The parallelized parameter ``target`` is (or aliases whole), when run eagerly on real memory."""
    if not isinstance(target, DTensor) or torch.compiler.is_compiling():
        return None
    local = target._local_tensor
    if local.is_meta or detect_fake_mode([local]) is not None:
        return None
    found = model_state.parameter_holding(target)
    return None if found is None else found[1]


# nn.init functions that read the tensor's shape (fan-in, rows and columns) and do not hand themselves to
# __torch_function__; those on a DTensor only where its shape is not the whole parameter's, but for the ones that
# also read across rows (orthogonal_, sparse_, eye_, dirac_).
_READS_SHAPE = frozenset({"xavier_uniform_", "xavier_normal_", "kaiming_normal_", "kaiming_uniform_"})
_READS_ACROSS_ROWS = frozenset({"orthogonal_", "sparse_", "eye_", "dirac_"})


def _refuse_init_on_a_part(frame: Any) -> None:
    """Refuse, by name, an ``nn.init`` function running (``frame`` is the innermost Python frame) on a parallelized
    parameter it would initialize from the part's shape (see the Note above)."""
    outermost = None
    while frame is not None and frame.f_globals.get("__name__") == "torch.nn.init":
        outermost, frame = frame, frame.f_back
    if outermost is None:
        return
    function, tensor = outermost.f_code.co_name, outermost.f_locals.get("tensor")
    if function not in _READS_SHAPE | _READS_ACROSS_ROWS or not isinstance(tensor, torch.Tensor):
        return
    found = model_state.parameter_holding(tensor)
    if found is None:
        return
    state, param = found
    if function in _READS_SHAPE and param.shape == whole_shape(param) and not isinstance(param, TensorParallelBlock):
        return  # a DTensor of the whole parameter's shape: its fan is the whole's
    names = state.names_of(param)
    part = param._local_tensor if isinstance(param, DTensor) else param
    raise OptionsError(
        f"nn.init.{function} on {names[0] if names else 'a parallelized parameter'}, which this rank holds in part "
        f"({tuple(part.shape)} of {tuple(whole_shape(param))}): it would read the part's shape or a gathered copy. "
        "Call it inside the module's own initializer (reset_parameters, the model's init_weights or _init_weights: "
        "dpar replays those on the whole parameter), or as dpar.init_weights(model, fn)"
    )


def _replay_at_full_size(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    target = args[0]
    if not torch.compiler.is_compiling():
        _refuse_init_on_a_part(sys._getframe(1))
    if op is aten.copy_.default and isinstance(args[1], DTensor):  # DTensor into DTensor: torch's own
        return _torch_default(op, args, kwargs)
    param = _holder(target)
    if param is None:
        return _torch_default(op, args, kwargs)
    if op is aten.copy_.default:
        _copy_whole(param, args[1])
    else:
        _whole_write(param, lambda full: op(full, *args[1:], **kwargs))
    return target


def _whole_write(param: torch.Tensor, write: Any) -> None:
    """``write(full)`` on a tensor of ``param``'s whole shape, then this rank's part of it into ``param``."""
    local = param._local_tensor if isinstance(param, DTensor) else param
    full = torch.empty(whole_shape(param), dtype=param.dtype, device=local.device)
    with torch.no_grad():
        write(full)
    write_part(full, param)


_RANDOM_METHODS = frozenset(
    getattr(torch.Tensor, name) for name in
    ("normal_", "uniform_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_")
)
_INIT_FUNCTIONS = frozenset(
    getattr(torch.nn.init, name) for name in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
        "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
    ) if hasattr(torch.nn.init, name)
)


_DATA_GETTER = torch.Tensor.data.__get__  # a new method-wrapper each time it is read: compared with ==


class TensorParallelBlock(torch.nn.Parameter):
    """A plain tensor-parallel block whose writes act on the whole parameter (see the Note above)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not torch.compiler.is_compiling():
            _refuse_init_on_a_part(sys._getframe(1))
            if func in _INIT_FUNCTIONS:  # nn.init hands itself over with the tensor as a keyword
                target = kwargs["tensor"] if "tensor" in kwargs else args[0]
                rest = {k: v for k, v in kwargs.items() if k != "tensor"}
                _whole_write(_block_parameter(target), lambda full: func(full, *args[1:] if args else (), **rest))
                return target
            target = args[0] if args else None
            if isinstance(target, TensorParallelBlock):
                if func in _RANDOM_METHODS:
                    _whole_write(_block_parameter(target), lambda full: func(full, *args[1:], **kwargs))
                    return target
                if func is torch.Tensor.copy_ and isinstance(args[1], torch.Tensor) and args[1].shape != target.shape:
                    _copy_whole(_block_parameter(target), args[1])
                    return target
        with torch_function_of_subclasses_disabled():
            result = func(*args, **kwargs)
        if type(func) is type(_DATA_GETTER) and func == _DATA_GETTER:  # writes through .data are the block's too
            result = result.as_subclass(TensorParallelBlock)
        return result


def _block_parameter(block: torch.Tensor) -> torch.Tensor:
    """The parameter ``block`` is (or, for ``.data``, whose memory it is)."""
    found = model_state.parameter_holding(block)
    return block if found is None else found[1]


def _copy_whole(param: torch.Tensor, source: torch.Tensor) -> None:
    """``param.copy_(source)`` as on the whole parameter: this rank keeps its part; a shape that does not broadcast
    to the whole is refused by name, nothing written."""
    shape = whole_shape(param)
    try:
        expanded = source.expand(shape)
    except RuntimeError:
        found = model_state.parameter_holding(param)
        names = found[0].names_of(param) if found is not None else []
        raise OptionsError(
            f"copy_ into {names[0] if names else 'a parallelized parameter'} (whole shape {tuple(shape)}) from a "
            f"tensor of shape {tuple(source.shape)}: copy the whole parameter's values (or ones that broadcast to its "
            "shape); this rank keeps its part of them"
        ) from None
    _whole_write(param, lambda full: full.copy_(expanded))


def keep_foreach_default(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer group left to choose (``foreach=None``) picks torch's foreach kernels only for plain parameters;
    a group holding blocks gets the choice torch makes for plain parameters on their devices."""
    supported = set(foreach_devices())
    for group in optimizer.param_groups:
        params = group["params"]
        if group.get("foreach", False) is None and any(isinstance(p, TensorParallelBlock) for p in params):
            group["foreach"] = all(p.device.type in supported for p in params) and not group.get("differentiable")


def as_block_parameter(param: torch.nn.Parameter) -> TensorParallelBlock:
    """``param`` (a plain split block) as a ``TensorParallelBlock`` on the same memory."""
    if isinstance(param, TensorParallelBlock):
        return param
    block = TensorParallelBlock(param.detach(), param.requires_grad)
    block.__dict__.update(param.__dict__)  # marks (broadcast, HF's _is_hf_initialized) travel with the values
    return block


def replay_writes_at_full_size() -> None:
    """Register the replay of [Note: a write the part cannot take as it stands] in DTensor's op table (once)."""
    handlers = dtensor_op_handlers()
    for op in (*RANDOM_IN_PLACE, aten.copy_.default):
        handlers.setdefault(op, _replay_at_full_size)
