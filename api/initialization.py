"""``dpar.init_weights``: a parallelized model initialized exactly as the whole model on one device.

[Note: replaying an initializer on full-size stand-ins]
After ``dpar.parallelize`` a module's parameter is a shard (fsdp, zero2: a
``Shard(0)`` DTensor), a tensor-parallel block, or both. An initializer run on
those directly draws its random numbers per shard: every rank's shard of a
weight gets the *same* numbers (one block repeated N times), and a split differs
from one device. Here each initializer call instead sees every parallelized
parameter it reads at its global shape: for the call, the modules' classes
revert to the user's class and their ``_parameters`` become a dict that, on
first read, gathers the parameter into a plain full-size tensor (a stand-in).
After the call, each rank copies its own part of every stand-in (its shard, its
block, its block's shard) into the real parameter and drops the stand-ins, so at
most what one call touches is full at once (one module, for a per-module
initializer). Every rank runs the same initializer on the same shapes in the
same order, so the random stream is consumed exactly as on one device, at any
world size and under any strategy. Reads of other modules (GPT-2's scaled
``c_proj`` init from its attention block) and tied weights (one stand-in per
parameter per call; a later call starts from what the earlier one wrote, as on
one device) follow from the same rule. What cannot be redirected, a write into a
parameter reached through a reference taken before ``parallelize`` or into a
shard itself, is refused by name (``InitializationError``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from dpar.core import model_state
from dpar.core.facts import retired_of, tensor_parallel_spec_of
from dpar.runtime.parameter_writes import write_part
from dpar.runtime.tensor_parallel import whole_parameter
from dpar.surgery import sharding, tensor_parallel
from dpar.core.errors import InitializationError

_DPAR_CLASS_MODULES = (sharding.__name__, tensor_parallel.__name__)


def _user_class(module: nn.Module) -> type[nn.Module]:
    """The class the user built ``module`` as, under dpar's ``Sharded``/``TensorParallel`` subclasses."""
    cls = type(module)
    while cls.__module__ in _DPAR_CLASS_MODULES:
        cls = cls.__mro__[1]
    return cls


def _is_parallelized(param: torch.Tensor) -> bool:
    """Whether ``param`` holds only part of its parameter on this rank (a shard, a tp block, or both)."""
    spec = tensor_parallel_spec_of(param)
    return isinstance(param, DTensor) or (spec is not None and spec.dim is not None)


def _gather(param: torch.Tensor) -> torch.Tensor:
    """The whole of ``param`` (a collective every rank issues alike)."""
    value = param.detach()
    if isinstance(value, DTensor):
        value = value.full_tensor()  # fsdp+tp: the tensor-parallel block
    spec = tensor_parallel_spec_of(param)
    if spec is not None and spec.dim is not None:
        value = whole_parameter(value, spec)
    return value.clone()


class _StandIns:
    """Full-size stand-ins of parallelized parameters, made on first read, shared by tied owners."""

    def __init__(self) -> None:
        self.made: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}  # id(real) -> (real, stand-in)
        self.released: dict[str, nn.Parameter] = {}  # dpar.pipeline: first name -> stand-in of another rank's parameter

    def of_released(self, key: str, shape: torch.Size, dtype: torch.dtype) -> nn.Parameter:
        """A stand-in for a parameter another pipeline rank's stage holds: drawn into here, then dropped."""
        if key not in self.released:
            self.released[key] = nn.Parameter(torch.empty(shape, dtype=dtype))
        return self.released[key]

    def of(self, real: torch.Tensor) -> nn.Parameter:
        if id(real) not in self.made:
            stand_in = nn.Parameter(_gather(real), requires_grad=real.requires_grad)
            if hasattr(real, "_is_hf_initialized"):  # HF's init functions skip a flagged tensor
                stand_in._is_hf_initialized = real._is_hf_initialized
            self.made[id(real)] = (real, stand_in)
        return self.made[id(real)][1]

    def replace(self, real: torch.Tensor, value: nn.Parameter) -> None:
        self.made[id(real)] = (real, value)

    def write_back(self) -> None:
        """Each real parameter takes its part of its stand-in; the stand-ins are dropped."""
        with torch.no_grad():
            for real, stand_in in self.made.values():
                write_part(stand_in, real)
        self.made.clear()
        self.released.clear()


class _FullSizeParameters(dict):
    """A module's ``_parameters`` while an initializer runs: parallelized entries read as their stand-ins."""

    def __init__(
        self, real: dict[str, torch.Tensor | None], stand_ins: _StandIns,
        released: dict[str, tuple[str, torch.Size, torch.dtype]] | None = None,
    ) -> None:
        super().__init__(real)
        self._released = released or {}  # dpar.pipeline: leaf -> (first name, shape, dtype) of another rank's parameter
        self._real = dict(real)
        # Decided before this dict is installed: looking a parameter's facts up reads the module's parameters.
        self._split = {name for name, p in real.items() if p is not None and _is_parallelized(p)}
        self._stand_ins = stand_ins

    def __getitem__(self, name: str) -> torch.Tensor | None:
        real = self._real.get(name)
        if name in self._released and dict.__getitem__(self, name) is None:
            return self._stand_ins.of_released(*self._released[name])
        if name in self._split and dict.__getitem__(self, name) is real:
            return self._stand_ins.of(real)
        return dict.__getitem__(self, name)

    def __setitem__(self, name: str, value: torch.Tensor | None) -> None:
        real = self._real.get(name)
        if name in self._split and value is not None:
            self._stand_ins.replace(real, value)  # the initializer assigned a new parameter: its values go back
        dict.__setitem__(self, name, value)

    def get(self, name: str, default: object = None) -> object:
        return self[name] if name in self else default

    def items(self):  # noqa: ANN201 (dict's view type)
        return [(name, self[name]) for name in self.keys()]

    def values(self):  # noqa: ANN201
        return [self[name] for name in self.keys()]


class _RefuseLostWrites(TorchFunctionMode):
    """Refuses an in-place write into a parameter the stand-ins cannot redirect: a shard or block itself, or
    a full parameter that ``parallelize`` replaced (a reference the initializer took before it)."""

    _IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.storages: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if _is_parallelized(param):
                local = param._local_tensor if isinstance(param, DTensor) else param
                self._add(local, f"the {'shard' if isinstance(param, DTensor) else 'block'} of {name}")
        for retired in retired_of(model):
            self._add(retired, "a full parameter that dpar.parallelize replaced by its shard")
        self.module_name = ""
        self.active = False  # only while the initializer runs: dpar's own write-back is allowed

    def _add(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.device.type != "meta" and tensor.numel():
            self.storages[tensor.untyped_storage().data_ptr()] = what

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = (name.endswith("_") and not name.endswith("__")) or name in self._IN_PLACE_DUNDERS
        target = kwargs.get("out") if "out" in kwargs else (args[0] if in_place and args else None)
        if self.active and isinstance(target, torch.Tensor):
            local = target._local_tensor if isinstance(target, DTensor) else target
            if local.device.type != "meta" and local.numel():
                what = self.storages.get(local.untyped_storage().data_ptr())
                if what is not None:
                    raise InitializationError(
                        f"the initializer of module {self.module_name or '(root)'} wrote in place ({name}) into "
                        f"{what}: "
                        "that write would miss the parameter or give every rank's shard the same numbers. Reach "
                        "parameters through their module inside the initializer (module.weight, "
                        "module.parameters()), not through references taken before dpar.parallelize, so dpar can "
                        "hand it the full-size parameter; or initialize the model before dpar.parallelize"
                    )
        return func(*args, **kwargs)


def _check_still_parallelized(model: nn.Module) -> None:
    """A module dpar parallelized whose parameter is no longer a shard or block dpar knows (replaced since, e.g. by
    ``to_empty`` without swapping tensors) would be initialized as if it were whole: refuse it by name."""
    for module_name, module in model.named_modules():
        cls = type(module)
        while cls.__module__ in _DPAR_CLASS_MODULES:
            for name, member in vars(cls).items():
                param = module._parameters.get(name)
                if isinstance(member, property) and param is not None and not _is_parallelized(param):
                    qualified = f"{module_name}.{name}" if module_name else name
                    raise InitializationError(
                        f"{qualified} was parallelized by dpar.parallelize, but its parameter has since been "
                        "replaced by one dpar does not know as a shard or block (model.to_empty or another "
                        "nn.Module._apply that makes new parameter objects), so this rank's part of the "
                        "initialization cannot be found: materialize the model before dpar.parallelize, or make "
                        "to_empty keep the parameters' identity "
                        "(torch.__future__.set_swap_module_params_on_conversion(True))"
                    )
            cls = cls.__mro__[1]


@contextlib.contextmanager
def _full_size(model: nn.Module) -> Iterator[tuple[_StandIns, _RefuseLostWrites]]:
    """While inside, every parallelized module reads its parameters at full size (see the Note above)."""
    _check_still_parallelized(model)
    stand_ins = _StandIns()
    guard = _RefuseLostWrites(model)
    swapped: list[tuple[nn.Module, type[nn.Module], dict]] = []
    released = _released_leaves(model)
    try:
        for module in model.modules():
            split = any(p is not None and _is_parallelized(p) for p in module._parameters.values())
            if split or id(module) in released:
                original = module.__dict__["_parameters"]
                swapped.append((module, type(module), original))
                module.__dict__["_parameters"] = _FullSizeParameters(original, stand_ins, released.get(id(module)))
                module.__class__ = _user_class(module)
        with guard:
            yield stand_ins, guard
    finally:
        for module, cls, original in swapped:
            module.__class__ = cls
            module.__dict__["_parameters"] = original


@contextlib.contextmanager
def _replaying(model: nn.Module, stand_ins: _StandIns) -> Iterator[None]:
    """Mark ``model`` as inside a full-size replay: a wrapped initializer called from it runs as it is."""
    state = model_state.state_of(model, create=True)
    state.replaying = stand_ins
    try:
        yield
    finally:
        state.replaying = None


# [Note: the model's own initializer, called on a parallelized model]
# Users initialize a model by calling its own initializer: ``module.reset_parameters()``, Hugging Face's
# ``post_init()`` / ``init_weights()`` / ``_init_weights(module)``, torchtitan's ``init_weights()``, usually after
# ``to_empty`` on a model born on meta. Run on the parallelized model as it is, a draw would be per shard (repaired
# per op for DTensor parameters, see runtime/parameter_writes.py) but a shape read would be the part's (a
# tensor-parallel block's ``fan_in`` in ``kaiming_uniform_``), and an index into a weight
# (``weight[padding_idx].zero_()``) would land in the wrong rows or in a gathered copy. So ``parallelize``
# replaces these methods on each module instance (an instance attribute over the class's method) by one that runs
# the class's method under the full-size stand-ins of [Note: replaying an initializer on full-size stand-ins] and
# writes every rank's part back after it: the numbers one device gets from the same call under the same seed.
# A call made inside another (``post_init`` calling ``_init_weights``, ``dpar.init_weights`` calling them) runs
# as it is inside the outer replay. A root-level call holds what it reads at full size until it returns (HF's
# ``post_init`` reads every parameter: the whole model on every rank); ``dpar.init_weights(model)`` writes back
# after each module and holds one module's parameters at a time.
OWN_INITIALIZERS = (
    "reset_parameters", "_reset_parameters", "init_weights", "_init_weights", "post_init", "initialize_weights",
)


def _replayed(model: nn.Module, module: nn.Module, method_name: str, qualified: str) -> Callable[..., Any]:
    method = getattr(type(module), method_name)
    model_ref = weakref.ref(model)

    @functools.wraps(method)
    def replay(*args: Any, **kwargs: Any) -> Any:
        root = model_ref()
        state = model_state.state_of(root) if root is not None else None
        if state is None or state.replaying is not None or torch.compiler.is_compiling():
            return method(module, *args, **kwargs)
        _check_same_generators(root)
        with torch.no_grad(), _full_size(root) as (stand_ins, refuse), _replaying(root, stand_ins):
            refuse.module_name = qualified
            refuse.active = True
            try:
                result = method(module, *args, **kwargs)
            finally:
                refuse.active = False
            stand_ins.write_back()
        return result

    return replay


def replay_own_initializers(model: nn.Module) -> None:
    """Wrap each module's own initializers as [Note: the model's own initializer, called on a parallelized model]
    says, where ``parallelize`` left some parameter on this rank in part or ``dpar.pipeline`` released some to
    other ranks' stages."""
    if not any(_is_parallelized(p) for p in model.parameters()) and "_dpar_pipeline" not in model.__dict__:
        return
    for qualified, module in model.named_modules():
        for name in OWN_INITIALIZERS:
            if callable(getattr(type(module), name, None)) and name not in module.__dict__:
                module.__dict__[name] = _replayed(model, module, name, qualified or "(root)")


def _released_leaves(model: nn.Module) -> dict[int, dict[str, tuple[str, torch.Size, torch.dtype]]]:
    """dpar.pipeline: id(module) -> leaf -> (first name, shape, dtype) of each parameter another rank's stage holds
    (``None`` in its module here). Every rank replays every module's init, these on stand-ins it then drops, so the
    random stream is the one device's (see [Note: a pipelined model's state] in ``api/pipelining.py``)."""
    pipelined = model.__dict__.get("_dpar_pipeline")
    if pipelined is None:
        return {}
    pipelined.retie()  # to_empty untied a tied weight: one parameter, initialized as on one device
    first = pipelined.first_names()
    leaves: dict[int, dict[str, tuple[str, torch.Size, torch.dtype]]] = {}
    for name, (shape, dtype) in pipelined.released().items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        leaves.setdefault(id(module), {})[leaf] = (first.get(name, name), shape, dtype)
    return leaves


def _own_initializer(model: nn.Module) -> Callable[[nn.Module], None]:
    """The model's own initializer, as one call per module in ``apply`` order: Hugging Face's ``_init_weights`` of
    the module's nearest ``PreTrainedModel``; else, at the topmost modules with an ``init_weights()`` (torchtitan),
    that method (their descendants do nothing: it recurses itself); else the module's ``reset_parameters()``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is optional
        PreTrainedModel = None  # type: ignore[assignment,misc]
    hf_owner: dict[int, nn.Module] = {}
    holders: set[int] = set()
    inside_holder: set[int] = set()

    def visit(module: nn.Module, hf: nn.Module | None, held: bool) -> None:
        if PreTrainedModel is not None and isinstance(module, PreTrainedModel):
            hf = module
        if hf is not None:
            hf_owner[id(module)] = hf
        elif held:
            inside_holder.add(id(module))
        elif callable(getattr(module, "init_weights", None)):
            holders.add(id(module))
            held = True
        for child in module.children():
            visit(child, hf, held)

    visit(model, None, False)

    def own(module: nn.Module) -> None:
        if id(module) in hf_owner:
            hf_owner[id(module)]._init_weights(module)
        elif id(module) in holders:
            module.init_weights()
        elif id(module) not in inside_holder and callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

    return own


def _hf_guard() -> contextlib.AbstractContextManager:
    """HF's own init context (torch.nn.init honours ``_is_hf_initialized``), where transformers is there."""
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:
        return contextlib.nullcontext()
    return guard_torch_init_functions()


def _check_same_generators(model: nn.Module) -> None:
    """Every rank must draw the same stream, or the ranks' parts come from different initializations."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if not any(_is_parallelized(p) for p in model.parameters()) and "_dpar_pipeline" not in model.__dict__:
        return  # every rank initializes all of it: no collective, so a plain model may be initialized on one rank
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    devices = {p.device for p in model.parameters() if p.device.type not in ("cpu", "meta")}
    for device in sorted(devices, key=str):
        accelerator = getattr(torch, device.type, None)
        if accelerator is not None and hasattr(accelerator, "get_rng_state"):
            digest.update(accelerator.get_rng_state(device).cpu().numpy().tobytes())
    states: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(states, digest.hexdigest())
    if len(set(states)) > 1:
        differing = [r for r, s in enumerate(states) if s != states[0]]
        raise InitializationError(
            f"the random generators of ranks {differing} differ from rank 0's, so each rank would initialize its part "
            "from a different stream: call torch.manual_seed(seed) with the same seed on every rank before "
            "dpar.init_weights"
        )


def init_weights(
    model: nn.Module, init: Callable[[nn.Module], None] | None = None, *, each_module: bool = True
) -> nn.Module:
    """Initialize a parallelized ``model`` in place exactly as ``init`` initializes the whole model on one device.

    ``init`` is applied to every module in ``nn.Module.apply``'s order (children first), or with
    ``each_module=False`` called once on the root. ``None`` is the model's own initializer: Hugging Face's
    ``_init_weights`` in ``apply`` order (ignoring the "already initialized" marks a built model carries), a
    topmost ``init_weights()`` (torchtitan's, one call that recurses itself), every other ``reset_parameters()``.
    Seed first, the same on every rank: ``torch.manual_seed(s); dpar.init_weights(model)`` gives the parameters
    that ``torch.manual_seed(s)`` and the same initializer give the whole model on one device, at any world size
    and under every strategy (see [Note: replaying an initializer on full-size stand-ins]). Works after
    ``model.to_empty(device=...)`` where that kept dpar's parameters (a replaced one is refused by name), and on a
    model ``torch.compile`` wrapped. Buffers are initialized as the initializer writes them (HF's rotary
    ``inv_freq`` is recomputed by HF's own init); ones it does not write keep their values.
    """
    module = getattr(model, "_orig_mod", model)
    if init is None:
        init = _own_initializer(module)
        guard = _hf_guard()
    else:
        guard = contextlib.nullcontext()
    _check_same_generators(module)
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    with torch.no_grad(), guard, _full_size(module) as (stand_ins, refuse), _replaying(module, stand_ins):

        def call(target: nn.Module) -> None:
            refuse.module_name = names.get(id(target), type(target).__name__)
            refuse.active = True
            try:
                init(target)
            finally:
                refuse.active = False
            stand_ins.write_back()

        def apply(target: nn.Module) -> None:  # nn.Module.apply's order, each call written back before the next
            for child in target.children():
                apply(child)
            call(target)

        if each_module:
            apply(module)
        else:
            call(module)
    return model
