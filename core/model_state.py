"""What dpar knows about one parallelized model, kept on the model and keyed by parameter name.

[Note: facts keyed by name, not by tensor]
A model born on the meta device is parallelized first and materialized after:
``model.to_empty(device=...)`` (which swaps DTensor parameters in place with
``torch.utils.swap_tensors``), then weights loaded, possibly with
``load_state_dict(assign=True)`` (which puts new Parameter objects in place).
``swap_tensors`` refuses a tensor that has any weak reference, so no table
keyed by parameter tensors (``WeakIdKeyDictionary``) may hold a live parameter;
and ``assign=True`` would orphan such a table's entries anyway. So the plan and
the per-parameter facts (a shard's global shape, a tensor-parallel block's
dimension) live in one ``ModelState`` stored as a plain attribute of the
parallelized root module, keyed by qualified parameter name. Where only a
tensor is at hand (the backend sees graph inputs), the owning model is found
through a weak set of parallelized *modules* and each state's ``id(tensor) ->
name`` map, checked by identity on every hit and rebuilt from
``named_parameters()`` / ``named_buffers()`` on a miss (``swap_tensors`` keeps
a parameter's Python identity, ``assign=True`` does not).

The same holds for what the first compile and the first optimizer step learn: a
compiled graph reaches its parameters and buffers through their ``Slot`` (the
owning module, weakly, and the leaf name), so it reads whatever tensor the model
holds there now; zero1's ranges and ``optimizer_in_graph`` are facts by name here;
the zero1 views are the optimizer's (runtime/zero1.py); what kinds of facts there are is
``facts.py``'s. Facts about a tensor's
*values* (broadcast from rank 0; a gradient accumulated under ``no_sync``) are
marks in the tensor's own ``__dict__``, which ``swap_tensors`` moves together with
the values. What is left that ``swap_tensors`` refuses is torch's: Dynamo's weak
tables after ``torch.compile`` of an optimizer step (dpar's ``optimizer_in_graph``,
and plain ``torch.compile(optimizer.step)`` alike).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parameter import UninitializedTensorMixin
from torch.nn.modules.module import (
    register_module_buffer_registration_hook, register_module_parameter_registration_hook,
)

from dpar.core.errors import UnmaterializedStateError

ATTRIBUTE = "_dpar_state"

_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # roots that have a ModelState
generation = 0  # moves whenever any state gains a fact: a tensor found in none before may be in one now


def changed() -> None:
    """Some tensor gained a fact (in a state, or a mark): answers cached by ``generation`` are stale."""
    global generation
    generation += 1


class ModelState:
    """The plan ``parallelize`` chose for one model and its per-parameter facts, by qualified name."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)  # the model holds its state; the state must not hold the model
        self.plan: Any = None  # core.plan.ParallelPlan; None: parallelize chose ddp
        # The pass listing's optimizer stage, handed down by the backend when it compiles the model's graphs, so
        # that the runtime's optimizer hooks capture and run the step without importing the compiler.
        self.optimizer_stage: OptimizerStage | None = None
        self._facts: dict[str, dict[str, Any]] = {}  # kind -> qualified name -> fact
        self._names: dict[int, list[str]] = {}  # id(tensor) -> the qualified names it is reachable under (tied: several)
        # Parameters and buffers on meta when parallelize ran, not yet seen written: id(owning module) -> leaf name -> qualified name.
        self._unwritten: dict[int, dict[str, str]] = {}
        self.eager_forwards = 0  # forwards of this model running eagerly now: see [Note: a parameter is its parameter]
        # While one of the model's initializers is replayed at full size (api/initialization.py): its stand-ins.
        self.replaying: Any = None

    @contextlib.contextmanager
    def eager_forward(self) -> Iterator[None]:
        """A forward of the model running eagerly: parallelized attributes read whole parameters inside."""
        self.eager_forwards += 1
        try:
            yield
        finally:
            self.eager_forwards -= 1

    def run_forward(self, forward: Callable[..., Any], module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """``forward(module, *args, **kwargs)`` for a swapped module's class: counted as an eager forward unless
        Dynamo traces it (where ``reads_whole_parameters`` is already true and the count would trace to nothing)."""
        if torch.compiler.is_compiling():
            return forward(module, *args, **kwargs)
        with self.eager_forward():
            return forward(module, *args, **kwargs)

    def reads_whole_parameters(self) -> bool:
        """Whether a parallelized module's attribute reads its whole parameter here (see the Note below)."""
        return torch.compiler.is_compiling() or self.eager_forwards > 0

    def model(self) -> nn.Module | None:
        """The model this state is of (None once it is gone)."""
        return self._model()

    def set_model_fact(self, kind: str, fact: Any) -> None:
        """A fact of the model as a whole that the runtime keeps for it (local SGD's period)."""
        self._facts.setdefault(kind, {})[""] = fact

    def model_fact(self, kind: str) -> Any:
        return self.facts(kind).get("")

    def set_fact(self, kind: str, name: str, fact: Any) -> None:
        self._facts.setdefault(kind, {})[name] = fact
        changed()

    def facts(self, kind: str) -> dict[str, Any]:
        return self._facts.get(kind, {})

    def _resolve(self, name: str) -> torch.Tensor | None:
        slot = self.slot(name)
        return None if slot is None else slot()

    def slot(self, name: str) -> Slot | None:
        """Where the parameter or buffer ``name`` lives: whatever tensor is there when asked."""
        model = self._model()
        if model is None:
            return None
        module_name, _, leaf = name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return None
        return Slot(weakref.ref(module), leaf)

    def rebuild(self) -> None:
        """Map every parameter and buffer of the model, as it is now, to its names."""
        model = self._model()
        self._names = {}
        if model is None:
            return
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self._names.setdefault(id(t), []).append(name)

    def cached_names_of(self, tensor: torch.Tensor) -> list[str]:
        """``tensor``'s qualified names if the map knows it and it is still that tensor (ids are reused)."""
        names = self._names.get(id(tensor), [])
        return names if names and self._resolve(names[0]) is tensor else []

    def names_of(self, tensor: torch.Tensor) -> list[str]:
        names = self.cached_names_of(tensor)
        if not names:
            self.rebuild()
            names = self.cached_names_of(tensor)
        return names

    def fact_of(self, kind: str, tensor: torch.Tensor) -> Any:
        facts = self.facts(kind)
        return next((facts[n] for n in self.names_of(tensor) if n in facts), None)


# [Note: a parameter is its parameter]
# After ``parallelize`` a module's parameter slot holds this rank's part (a ``Shard(0)`` DTensor, a tensor-parallel
# block, or the DTensor shard of a block). A forward reads the whole parameter: the swapped classes of
# surgery/sharding.py and surgery/tensor_parallel.py answer ``module.weight`` with the gather (traced into the
# graphs' collectives) or the tensor-parallel marker. Everywhere else the attribute is the parameter itself, the
# object ``named_parameters()`` yields, as FSDP2 and torch's tensor parallel keep it, so what a user writes through
# the module (``copy_``, ``fill_``, ``nn.init.*``, ``requires_grad_``, ``.data``) acts on what trains; a write the
# part cannot take as it stands (a random draw, a copy of the whole tensor) is replayed at full size by
# runtime/parameter_writes.py. "In a forward" is: while Dynamo traces (``torch.compiler.is_compiling()``, a
# constant there, so the graphs are what they were) or while a forward of the model runs eagerly (evaluation
# under ``no_grad``, dpar's own tracing on fake tensors), counted by ``eager_forwards``: the root's forward hooks
# and each swapped module's ``forward`` (a submodule called on its own) enter and leave it.


class CapturedStep(Protocol):
    """An optimizer's step as a compiled graph: calling it steps (``StepNotCaptured`` where Dynamo cannot
    capture it whole); ``ran`` says whether the last call ran the graph (Dynamo may run a frame eagerly)."""

    ran: bool

    def __call__(self) -> Any: ...


class OptimizerStage(Protocol):
    """The "optimizer" stage of the pass listing (compiler/optimizer_step.py), as the runtime calls it.

    ``ranges`` are zero1's (the views the optimizer steps and their whole parameters), with ``group``
    (process group name, size) to gather them over; none for a step with no passes.
    """

    def capture(
        self, optimizer: torch.optim.Optimizer, ranges: Sequence[Any] = (), group: tuple[str, int] = ("", 1)
    ) -> CapturedStep:
        """The step captured by Dynamo, through the stage's passes, compiled by Inductor."""
        ...

    def after_eager(
        self, optimizer: torch.optim.Optimizer, ranges: Sequence[Any], group: tuple[str, int]
    ) -> Callable[[], None]:
        """The stage's passes alone, to run after a step that ran eagerly (zero1's gather)."""
        ...


class Slot:
    """A module's parameter or buffer by its leaf name: the tensor there now (None: the module is gone).

    Modules keep their identity through ``to_empty``, ``swap_tensors`` and ``load_state_dict(assign=True)``,
    which replace the tensors in a module's dicts: a slot, unlike a reference to the tensor, follows them.
    """

    __slots__ = ("_module", "_leaf")

    def __init__(self, module: weakref.ref[nn.Module], leaf: str) -> None:
        self._module, self._leaf = module, leaf

    def __call__(self) -> torch.Tensor | None:
        module = self._module()
        if module is None:
            return None
        # The dicts themselves, not a subclass's view of them (dpar.init_weights shows full-size stand-ins there).
        return dict.get(module._parameters, self._leaf, dict.get(module._buffers, self._leaf))


def slots_of(tensors: Iterable[torch.Tensor]) -> list[Callable[[], torch.Tensor | None]]:
    """For each tensor, a way back to it that holds no reference to it: its slot in the parallelized model that
    holds it, or (a model never parallelized) a weak reference, which ``swap_tensors`` then refuses."""
    tensors = list(tensors)
    found = []
    for tensor, owner in zip(tensors, owners_of(tensors)):
        names = owner.cached_names_of(tensor) if owner is not None else []
        slot = owner.slot(names[0]) if names else None
        found.append(slot if slot is not None else weakref.ref(tensor))
    return found


def state_of(model: nn.Module, create: bool = False) -> ModelState | None:
    """``model``'s state (the one of ``torch.compile``'s wrapped module for an ``OptimizedModule``)."""
    model = getattr(model, "_orig_mod", model)
    state = model.__dict__.get(ATTRIBUTE)
    if state is None and create:
        state = ModelState(model)
        model.__dict__[ATTRIBUTE] = state  # a plain attribute: not a submodule, not in state dicts
        _models.add(model)
    return state


def states() -> list[ModelState]:
    """The states of every parallelized model still alive."""
    return [s for m in list(_models) if (s := state_of(m)) is not None]


def owners_of(tensors: Iterable[torch.Tensor]) -> list[ModelState | None]:
    """For each tensor, the state of the parallelized model that holds it (None: none does).

    Every map is rebuilt at most once per call, and only when some tensor is not found.
    """
    tensors = list(tensors)
    alive = states()

    def find(t: torch.Tensor) -> ModelState | None:
        return next((s for s in alive if s.cached_names_of(t)), None)

    found = [find(t) for t in tensors]
    if any(f is None for f in found):
        for s in alive:
            s.rebuild()
        found = [f if f is not None else find(t) for f, t in zip(found, tensors)]
    return found


def parameter_holding(tensor: torch.Tensor) -> tuple[ModelState, torch.Tensor] | None:
    """The parallelized model's parameter whose memory on this rank ``tensor`` is, whole (the parameter itself,
    its ``.data`` or ``detach()``), with that model's state; None for any other tensor."""
    key = _memory_key(tensor)
    if key is None:
        return None
    for model in list(_models):
        state = state_of(model)
        for param in model.parameters():
            if _memory_key(param) == key:
                return state, param
    return None


def _memory_key(tensor: torch.Tensor) -> tuple[int, int, torch.Size] | None:
    """Where this rank's memory of ``tensor`` is (storage, offset, shape); None where it has none: meta, a lazy
    module's ``UninitializedParameter``, an empty storage."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # no autograd node, unlike to_local()
    if isinstance(local, UninitializedTensorMixin) or local.is_meta:
        return None
    pointer = local.untyped_storage().data_ptr()
    return None if pointer == 0 else (pointer, local.storage_offset(), local.shape)


def fact_of(kind: str, tensor: torch.Tensor) -> Any:
    """The ``kind`` fact of the parameter ``tensor`` is, in whichever parallelized model holds it."""
    (state,) = owners_of([tensor])
    return None if state is None else state.fact_of(kind, tensor)


def model_fact_of(kind: str, tensor: torch.Tensor) -> Any:
    """The ``kind`` fact of the parallelized model that holds ``tensor``."""
    (state,) = owners_of([tensor])
    return None if state is None else state.model_fact(kind)


# [Note: state of a model born on meta]
# ``to_empty`` gives every parameter and buffer uninitialized memory. Their values come from the model's own
# init (HF ``_init_weights``, torchtitan ``init_weights``, ``reset_parameters``) or a load, which the user runs
# after ``to_empty``; a state dict does not hold non-persistent buffers (HF's rotary ``inv_freq``, torchtitan's
# ``freqs_cis``), so their values come from the init alone. dpar cannot compute the values itself, and training
# on that memory gives numbers with no error, so a parameter or buffer that was on meta at ``parallelize`` must
# have been written since: in place (its ``_version``, or its local part's, moves off 0, which a fresh
# ``to_empty`` tensor has: ``nn.init``, ``copy_``, ``load_state_dict``, DCP and dpar's own loads all count) or
# assigned (the registration hooks below: ``load_state_dict(assign=True)``). Otherwise the first compile
# refuses it by name. A write through ``.data`` is not seen (``.data`` has a version counter of its own): the
# error says so. A ``model.to(dtype)`` after loading also makes fresh tensors: run it before loading.


def _note_write(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    for model in list(_models):
        state = state_of(model)
        if state is not None and id(module) in state._unwritten:
            state._unwritten[id(module)].pop(name, None)


_hooks_installed = False  # torch's registration hooks are process-wide only: one of each, registered once


def record_meta_state(model: nn.Module) -> None:
    """Before ``model`` (some of whose parameters or buffers are on meta) is materialized: remember which must be
    written (see [Note: state of a model born on meta])."""
    global _hooks_installed
    unwritten: dict[int, dict[str, str]] = {}
    for module_name, module in model.named_modules():
        for leaf, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None and is_meta(t):
                unwritten.setdefault(id(module), {})[leaf] = f"{module_name}.{leaf}" if module_name else leaf
    if not unwritten:
        return
    state_of(model, create=True)._unwritten = unwritten
    if not _hooks_installed:
        register_module_buffer_registration_hook(_note_write)
        register_module_parameter_registration_hook(_note_write)
        _hooks_installed = True


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The memory this rank holds of ``t``: a DTensor's local tensor, or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_meta(t: torch.Tensor) -> bool:
    """Whether this rank's part of ``t`` has no memory."""
    return local_part(t).is_meta


def check_materialized(state: list[tuple[str, str, torch.Tensor]]) -> None:
    """Refuse, by name, a graph whose parameters or buffers a meta-born model never got values for."""
    meta = next((f"{kind} {name}" for kind, name, t in state if is_meta(t)), None)
    if meta is not None:
        raise UnmaterializedStateError(
            f"{meta} is still on the meta device: a model built under torch.device('meta') needs "
            "model.to_empty(device=...) and its weights loaded (set_model_state_dict, dcp.load or "
            "load_state_dict) before the first step"
        )
    owners = {id(s): s for s in owners_of([t for kind, _, t in state if kind == "parameter"]) if s is not None}
    for owner in owners.values():
        for module_id, leaves in list(owner._unwritten.items()):
            for leaf, name in list(leaves.items()):
                tensor = owner._resolve(name)
                if tensor is None or (not is_meta(tensor) and max(tensor._version, local_part(tensor)._version) > 0):
                    del leaves[leaf]  # released to another pipeline rank's stage, or written in place since to_empty
                    continue
                kind = "parameter" if isinstance(tensor, nn.Parameter) else "buffer"
                raise UnmaterializedStateError(
                    f"{kind} {name} was on the meta device when dpar.parallelize ran and has not been written "
                    "since model.to_empty(): it holds uninitialized memory. Give it its values after to_empty with "
                    "the model's own init (reset_parameters(); HF: model.post_init() or model._init_weights(module); "
                    "torchtitan: model.init_weights(buffer_device=...); or dpar.init_weights(model)) or load it "
                    "(set_model_state_dict, dcp.load, dpar.load_safetensors); a non-persistent buffer is not in a "
                    "state dict. A write through .data is not seen here: write the tensor itself under "
                    "torch.no_grad()"
                )
