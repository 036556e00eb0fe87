"""Every private torch name dpar reaches, in one place, each with the reason no public API serves.

dpar is a torch.compile backend and a c10d user, so it lives on some of torch's internals: Dynamo's
and Inductor's entry points, AOTAutograd's partitioner, c10d's group registry, DTensor's shard
arithmetic. Product code imports them from here and nowhere else, and
``tests/test_torch_internals.py`` resolves every entry of ``PRIVATE_NAMES`` on the torch it runs on,
so a release that moves one fails one named test instead of a strategy at its first step.

Cheap imports are bound at import time; Inductor and Dynamo internals that cost seconds to import
are reached through small functions (their import stays lazy).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives  # the traceable collectives
import torch.utils._pytree as pytree  # the flattening every torch tracer uses; no public twin
from torch._C import DispatchKey
from torch._dynamo.callback import callback_handler as dynamo_compile_callbacks  # Dynamo's compile start/end hooks
from torch._dynamo.exc import FailOnRecompileLimitHit, ShortenTraceback, Unsupported
from torch._guards import detect_fake_mode
from torch._library.fake_class_registry import FakeScriptObject
from torch._logging import trace_structured  # TORCH_TRACE artifacts, for tlparse
from torch._logging._internal import trace_log  # its handlers say whether a structured trace is written
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _make_graph_module  # a GraphModule that writes its code when run or read
from torch.distributed.tensor._collective_utils import pad_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Shard
from torch.optim.optimizer import _use_grad_for_differentiable as use_grad_for_differentiable

# The op namespace functional collectives trace into: what dpar's passes insert and match.
C10D_FUNCTIONAL = torch.ops._c10d_functional
OpOverload = torch._ops.OpOverload  # the type of an ATen overload (``aten.mm.default``) in a graph
# A symbolic size's hint without a guard: torch 2.11 (the GPU machines' torch) names optimization_hint hint_int, with the
# same (value, fallback).
try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint
# A reduce-scatter of one tensor, traceable: torch 2.13 renamed 2.11's reduce_scatter_tensor (the GPU machines' torch)
# to reduce_scatter_single, and the old name warns there.
reduce_scatter_single = getattr(functional_collectives, "reduce_scatter_single", None) or functional_collectives.reduce_scatter_tensor
# Expert parallel's token exchange: the traceable all-to-all, and its autograd form (the transposed all-to-all backward).
all_to_all_single = functional_collectives.all_to_all_single
all_to_all_single_autograd = functional_collectives.all_to_all_single_autograd
grouped_mm = torch._grouped_mm  # MoE experts' batched matmul (torchtitan's DeepSeek), which tp must follow

# (module, attribute): what the test resolves. An attribute of None: the module itself.
PRIVATE_NAMES: tuple[tuple[str, str | None], ...] = (
    ("torch.distributed._functional_collectives", None),
    ("torch.distributed._functional_collectives", "all_to_all_single"),
    ("torch.distributed._functional_collectives", "all_to_all_single_autograd"),
    ("torch.utils._pytree", None),
    ("torch._C", "DispatchKey"),
    ("torch._dynamo.callback", "callback_handler.register_start_callback"),
    ("torch._dynamo.callback", "callback_handler.register_end_callback"),
    ("torch._dynamo.callback", "callback_handler.start_callbacks"),
    ("torch._dynamo.exc", "FailOnRecompileLimitHit"),
    ("torch._dynamo.exc", "ShortenTraceback"),
    ("torch._dynamo.exc", "Unsupported"),
    ("torch._guards", "detect_fake_mode"),
    ("torch._library.fake_class_registry", "FakeScriptObject"),
    ("torch._logging", "trace_structured"),
    ("torch._logging._internal", "trace_log"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch.fx._lazy_graph_module", "_make_graph_module"),
    ("torch.distributed.tensor._collective_utils", "pad_tensor"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch.distributed.tensor.placement_types", "Shard._reduce_shard_tensor"),
    ("torch.optim.optimizer", "_use_grad_for_differentiable"),
    ("torch.ops", "_c10d_functional"),
    ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.distributed.distributed_c10d", "_world"),
    ("torch.distributed", "ProcessGroup._get_sequence_number_for_group"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel._get_active_ddp_module"),
    ("torch.distributed.checkpoint.state_dict", "_load_model_state_dict"),
    ("torch.testing._internal.distributed.fake_pg", None),
    ("torch._dynamo.backends.common", "aot_autograd"),
    ("torch._dynamo.backends.registry", "_BACKENDS"),
    ("torch._dynamo.backends.registry", "register_backend"),
    ("torch._functorch", "config"),
    ("torch._functorch.partitioners", "must_recompute"),
    ("torch._inductor", "config"),
    ("torch._inductor.compile_fx", "compile_fx"),
    ("torch._inductor.compile_fx", "compile_fx_inner"),
    ("torch._inductor.custom_graph_pass", "CustomPartitionerFn"),
    ("torch._inductor.pattern_matcher", "stable_topological_sort"),
    ("torch._decomp", "global_decomposition_table"),
    ("torch._meta_registrations", None),
    ("torch._ops", "OpOverload"),
    ("torch._C", "_dispatch_has_kernel_for_dispatch_key"),
    ("torch", "_grouped_mm"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher._custom_op_handlers"),
    ("torch._C", "DisableTorchFunctionSubclass"),
    ("torch.utils._foreach_utils", "_get_foreach_kernels_supported_devices"),
)


def resolve(module: str, attribute: str | None) -> Any:
    """``module.attribute`` (dotted attributes followed), importing ``module``."""
    value: Any = importlib.import_module(module)
    for part in (attribute or "").split(".") if attribute else ():
        value = getattr(value, part)
    return value


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The group this process knows as ``group_name``: functional collectives name groups by string, and
    c10d offers the name -> group lookup only privately."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def default_store() -> dist.Store:
    """The default group's rendezvous store (dpar's agreement and liveness keys live there)."""
    return dist.distributed_c10d._get_default_store()


def groups_and_ranks() -> dict[Any, list[int]]:
    """c10d's registry of every group this process created, with its members' global ranks."""
    return dist.distributed_c10d._world.pg_group_ranks


def sequence_number(group: dist.ProcessGroup) -> int:
    """How many collectives this process has issued on ``group`` (what a stalled peer is compared by)."""
    return group._get_sequence_number_for_group()


def full_state_dict_loader_code() -> Any:
    """The code object of torch's own model state-dict loader (``set_model_state_dict`` with
    ``full_state_dict=True`` loads through it; see [Note: torch's full-state-dict loader] in
    surgery/tensor_parallel.py)."""
    import inspect

    from torch.distributed.checkpoint import state_dict

    return inspect.unwrap(state_dict._load_model_state_dict).__code__  # under its torch.no_grad() wrapper


def per_chunk_shard_reducer() -> Any:
    """DTensor's reduce-scatter of a ``Shard`` placement, which dpar pads once instead of per chunk."""
    return Shard._reduce_shard_tensor


def set_shard_reducer(reducer: Any) -> None:
    Shard._reduce_shard_tensor = reducer  # type: ignore[method-assign]


def register_step_pre_hook_first(optimizer: torch.optim.Optimizer, hook: Any) -> Any:
    """``optimizer.register_step_pre_hook(hook)``, run before the pre-hooks it already has: torch offers no
    ``prepend=`` for optimizer hooks, so the handle moves to the front of the optimizer's private hook dict."""
    handle = optimizer.register_step_pre_hook(hook)
    optimizer._optimizer_step_pre_hooks.move_to_end(handle.id, last=False)
    return handle


def frame_running(code: types.CodeType, limit: int | None = None) -> types.FrameType | None:
    """The innermost frame running ``code`` among the callers of the function that asks (the nearest ``limit`` of
    them, or all): how dpar tells which torch function is reading a module when torch passes no flag."""
    frame = sys._getframe(2)
    for _ in itertools.count() if limit is None else range(limit):
        if frame is None or frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def inside_ddp_constructor() -> bool:
    """Whether torch DDP's ``__init__`` is on the Python stack (it reads each module's own parameters to build its
    reducer and broadcast them): no public call says a module is being wrapped."""
    return frame_running(torch.nn.parallel.DistributedDataParallel.__init__.__code__) is not None


def active_ddp_module() -> torch.nn.Module | None:
    """The torch DDP wrapper whose forward is running, or None: DDP records it for Dynamo's DDPOptimizer,
    and no public call says whether a module runs inside a DDP forward."""
    return torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()


def register_fake_backend() -> None:
    """The ``"fake"`` c10d backend (torch's fake process group) is registered only by torch's testing
    package, on import; dpar's inspection simulates N ranks with it (and a public ``HashStore``)."""
    importlib.import_module("torch.testing._internal.distributed.fake_pg")


def _composite_ops_with_python_meta() -> list[torch._ops.OpOverload]:
    import torch._decomp  # noqa: F401  (fills the tables and, through _meta_registrations, the Meta kernels)
    import torch._meta_registrations  # noqa: F401

    ops = {}
    for table in torch._decomp.global_decomposition_table.values():
        for op in table:
            if (
                isinstance(op, torch._ops.OpOverload)
                and DispatchKey.Meta in op.py_kernels
                and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
            ):
                ops[str(op)] = op
    return list(ops.values())


@contextlib.contextmanager
def python_meta_kernels_lifted() -> Iterator[None]:
    """The Python ``Meta`` kernels of CompositeImplicitAutograd ops removed for a while (see [Note: meta models
    lose their gradients under the python dispatcher] in inspection/meta.py): torch registers them from its
    private decomposition tables, and an op's Python kernels and dispatch cache are private attributes."""
    lifted = [(op, op.py_kernels.pop(DispatchKey.Meta)) for op in _composite_ops_with_python_meta()]
    for op, _ in lifted:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in lifted:
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


def aot_autograd(**kwargs: Any) -> Any:
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def register_dynamo_backend(name: str, backend: Any) -> None:
    """Register ``backend`` under ``name`` unless Dynamo already has one (the entry point may have)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if name not in _BACKENDS:
        register_backend(compiler_fn=backend, name=name)


def functorch_config() -> Any:
    return torch._functorch.config


def inductor() -> Any:
    """Inductor's config, ``compile_fx``, ``compile_fx_inner`` and the partitioner hook type, as a namespace."""
    import types

    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return types.SimpleNamespace(config=config, compile_fx=compile_fx, compile_fx_inner=compile_fx_inner,
                                 CustomPartitionerFn=CustomPartitionerFn)


def structured_trace_on() -> bool:
    """Whether ``TORCH_TRACE`` has torch write a structured trace: its file handler, always installed, has a
    directory then. (Other handlers on the trace's logger, such as a test runner's capture, do not count.)"""
    return any(getattr(handler, "root_dir", None) is not None for handler in trace_log.handlers)


@contextlib.contextmanager
def no_stack_traces() -> Iterator[None]:
    """Tracing that records no Python stack on each node (``torch.fx.config.do_not_emit_stack_traces``): dpar reads
    no node's ``stack_trace``, and extracting one per node was a fifth of ``torch.export``'s time on Llama-3-70B
    (the planner's capture: 7.0-7.6 s -> 5.5-6.0 s, 2026-12-01). A torch without the flag traces as before."""
    import torch.fx.config as fx_config

    before = getattr(fx_config, "do_not_emit_stack_traces", False)
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``fx.GraphModule(root, graph)``, lazy inside a compile (Dynamo's compiles ask for lazy graph modules): its
    Python code is written when it first runs or is read, not by every pass's ``recompile``, which at Llama-3-70B's
    width took about a second a pass on a tensor-parallel copy's unrolled graph. Outside a compile: eager, as
    ``fx.GraphModule``."""
    return _make_graph_module(root, graph)


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    from torch._inductor.pattern_matcher import stable_topological_sort as sort

    sort(graph)


def dtensor_op_handlers() -> dict[OpOverload, Any]:
    """DTensor's table of ops it hands to a Python function instead of propagating their sharding: the one place
    to make a random draw or a copy into a parallelized parameter act as on the whole parameter
    (runtime/parameter_writes.py); torch offers no public hook for a DTensor op."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers


def torch_function_of_subclasses_disabled() -> Any:
    """A context in which a tensor subclass's ``__torch_function__`` runs the function as on a plain tensor (what
    torch's own default ``__torch_function__`` does inside), for ``TensorParallelBlock`` in
    runtime/parameter_writes.py; torch exposes it under ``torch._C`` only."""
    return torch._C.DisableTorchFunctionSubclass()


def foreach_devices() -> list[str]:
    """The device types torch's optimizers default to foreach kernels on (for plain parameters): torch names them
    in a private helper only."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return _get_foreach_kernels_supported_devices()


def must_recompute(node: torch.fx.Node) -> bool:
    from torch._functorch.partitioners import must_recompute as recompute

    return recompute(node)


__all__ = [
    "C10D_FUNCTIONAL", "DispatchKey", "active_ddp_module", "OpOverload", "grouped_mm", "FailOnRecompileLimitHit", "FakeScriptObject", "FakeTensorMode", "PRIVATE_NAMES",
    "ShortenTraceback", "Unsupported", "aot_autograd", "compute_local_shape_and_global_offset", "default_store",
    "detect_fake_mode", "dtensor_op_handlers", "dynamo_compile_callbacks", "foreach_devices", "frame_running", "inside_ddp_constructor", "full_state_dict_loader_code", "no_stack_traces", "functional_collectives", "functorch_config", "groups_and_ranks",
    "inductor", "must_recompute", "python_meta_kernels_lifted", "pad_tensor", "per_chunk_shard_reducer", "pytree", "register_dynamo_backend",
    "register_fake_backend", "register_step_pre_hook_first", "resolve", "resolve_process_group", "sequence_number", "set_shard_reducer",
    "stable_topological_sort", "torch_function_of_subclasses_disabled", "trace_structured", "use_grad_for_differentiable",
]
