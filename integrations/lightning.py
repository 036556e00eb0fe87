"""dpar as a Lightning strategy: ``Trainer(strategy=DparStrategy("fsdp"))`` and ``Fabric(strategy=DparFabricStrategy("fsdp"))``.

Both are Lightning's own DDP strategies (launcher, process group, ``DistributedSampler``, rank bookkeeping)
with the DDP wrap replaced by dpar's two calls: ``dpar.parallelize`` places the parameters for the chosen
strategy, and ``torch.compile(module, backend="dpar")`` takes the wrap's place.

[Note: what Lightning sees of a parallelized module]
- The compiled module stands where DDP's wrapper stood, and the Trainer's whole ``training_step`` (and the
  other steps) runs compiled with the dpar backend (``_CompiledSteps``): every parameter the step reads, also
  through ``self.net(x)`` rather than ``self(x)``, is read inside a dpar graph, and ``self.log`` is a graph
  break like any other.
  (torch's in-place ``module.compile()`` is no substitute: it compiles nothing of a module whose ``forward``
  is torch's own, an ``nn.Sequential``, which would then train eagerly with unsynchronised gradients.)
- Optimizers must hold the parameters ``parallelize`` placed. The Trainer builds them after ``setup``
  (``configure_optimizers``), so they do; Fabric's ``setup(model, optimizer)`` hands over one built
  before, whose still-empty parameter groups are pointed at the placed parameters by name.
- Gradient accumulation (``accumulate_grad_batches``, ``fabric.no_backward_sync``) is ``dpar.no_sync``.
- Checkpoints are directories: ``dpar.checkpoint.save``/``load`` write and read the model and optimizer (in
  shards under the sharded strategies, reshardable, never torn), and ``lightning_state.pt`` beside them holds
  the rest of what Lightning or the user saves (loops, callbacks, the step count).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning_fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning_fabric.strategies.strategy import _BackwardSyncControl
from pytorch_lightning.strategies import DDPStrategy as TrainerDDPStrategy
from pytorch_lightning.strategies.strategy import _ForwardRedirection

import dpar

LIGHTNING_STATE = "lightning_state.pt"  # in a checkpoint directory: what is not the model or its optimizer


def _place(
    module: nn.Module, strategy: str, options: Mapping[str, Any], example_inputs: Sequence[Any] | None,
    parallelize_kwargs: Mapping[str, Any],
) -> nn.Module:
    """``dpar.parallelize`` ``module`` in place; return it compiled with the dpar backend.

    ``example_inputs`` (tensor parallel's planning forward) default to the module's own
    ``example_input_array``, Lightning's convention for an example batch.
    """
    if example_inputs is None:
        example = getattr(module, "example_input_array", None)
        example_inputs = None if example is None else (example if isinstance(example, (tuple, list)) else (example,))
    dpar.parallelize(module, strategy=strategy, example_inputs=example_inputs, **parallelize_kwargs)
    return torch.compile(module, backend="dpar", options=dict(options))


def _point_at_placed(module: nn.Module, optimizer: torch.optim.Optimizer, before: Mapping[int, str]) -> None:
    """Point an optimizer built before ``parallelize`` at the parameters it placed, by name.

    ``before`` maps ``id`` of each parameter the module held before ``parallelize`` to its name. An
    optimizer that has stepped already holds state for the old tensors: it is refused.
    """
    if optimizer.state:
        raise dpar.OptionsError(
            f"this {type(optimizer).__name__} has already stepped, so its state belongs to the parameters "
            "dpar.parallelize replaced: hand Fabric an optimizer that has not stepped yet, or call "
            "fabric.setup_module(model) first and build the optimizer from model.parameters()"
        )
    placed = dict(module.named_parameters())
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in before]
        if unknown:
            raise dpar.OptionsError(
                f"this {type(optimizer).__name__} holds {len(unknown)} tensor(s) that are not parameters of the "
                "module set up with it: build it from model.parameters()"
            )
        group["params"] = [placed[before[id(p)]] for p in group["params"]]


def _parameter_names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _save_directory(
    path: str | os.PathLike[str], module: nn.Module, optimizer: torch.optim.Optimizer | None, rest: dict[str, Any],
) -> None:
    """``dpar.checkpoint.save`` the model and optimizer into ``path``, then rank 0 writes ``rest`` beside them."""
    dpar.checkpoint.save(module, optimizer, path)
    if not dist.is_initialized() or dist.get_rank() == 0:
        partial = Path(path) / f"{LIGHTNING_STATE}.partial"
        torch.save(rest, partial)
        os.replace(partial, Path(path) / LIGHTNING_STATE)
    if dist.is_initialized():
        dist.barrier()


def _load_directory(
    path: str | os.PathLike[str], module: nn.Module, optimizer: torch.optim.Optimizer | None,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Load what ``save_directory`` wrote: the model and optimizer in place; the rest is returned."""
    rest_file = Path(path) / LIGHTNING_STATE
    if not rest_file.is_file():
        raise dpar.CheckpointError(
            f"{path} holds no {LIGHTNING_STATE}: it is not a checkpoint a dpar Lightning strategy wrote "
            "(or its save stopped after the model was written)"
        )
    dpar.checkpoint.load(module, optimizer, path)
    return torch.load(rest_file, map_location="cpu", weights_only=bool(weights_only))


def _one_optimizer(optimizers: Sequence[torch.optim.Optimizer]) -> torch.optim.Optimizer | None:
    if len(optimizers) > 1:
        raise dpar.OptionsError(
            f"dpar.checkpoint saves one optimizer with its model; this run has {len(optimizers)}: "
            "use one optimizer with several parameter groups"
        )
    return optimizers[0] if optimizers else None


class DparStrategy(TrainerDDPStrategy):
    """The Lightning Trainer's strategy for dpar: ``Trainer(strategy=DparStrategy("fsdp"), devices=2)``.

    ``strategy`` is dpar's (``"ddp"``, ``"zero1"``, ``"zero2"``, ``"fsdp"``, ``"tp"``, ...); ``options`` go to
    ``torch.compile(..., options=...)``, ``example_inputs`` (else the module's ``example_input_array``) and the
    remaining keywords (``mesh``, ``param_dtype``, ...) to ``dpar.parallelize``. Lightning's own keywords of
    ``DDPStrategy`` it takes (``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
    ``precision_plugin``, ``process_group_backend``, ``start_method``) keep their meaning.
    """

    def __init__(
        self, strategy: str = "fsdp", *, options: Mapping[str, Any] | None = None,
        example_inputs: Sequence[Any] | None = None, accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
        checkpoint_io: Any = None, precision_plugin: Any = None, process_group_backend: str | None = None,
        start_method: str = "popen", **parallelize_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, start_method=start_method,
        )
        self.dpar_strategy = strategy
        self._options = dict(options or {})
        self._example_inputs = example_inputs
        self._parallelize_kwargs = parallelize_kwargs
        self._placed: Any = None  # the compiled LightningModule (a torch OptimizedModule)
        self._forward_redirection = _CompiledSteps(self._options)

    def configure_ddp(self) -> None:
        """In place of DDP's wrap: parallelize and compile the LightningModule itself (once per module)."""
        module = self.lightning_module
        if self._placed is None or self._placed._orig_mod is not module:
            self._placed = _place(module, self.dpar_strategy, self._options, self._example_inputs, self._parallelize_kwargs)
        self.model = self._placed

    def setup(self, trainer: Any) -> None:
        """DDP's setup with ``configure_ddp`` also outside fitting: a checkpoint loads into the placed layout."""
        from lightning_fabric.utilities.optimizer import _optimizers_to_device
        from pytorch_lightning.trainer.states import TrainerFn

        if self._layer_sync is not None:
            raise dpar.OptionsError(
                "Trainer(sync_batchnorm=True) swaps in torch's SyncBatchNorm, whose collectives run outside "
                "dpar's graphs: leave it off (dpar broadcasts rank 0's buffers each forward, as DDP does)"
            )
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.configure_ddp()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Lightning clips with torch's clip_grad_norm_, which under tp reads each rank's blocks alone: the
        # plugin this strategy owns clips by dpar's global norm instead (no public hook: an attribute of ours).
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = lambda optimizer, clip_val: dpar.clip_grad_norm_(plugin.main_params(optimizer), clip_val)
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def teardown(self) -> None:
        """DDP's teardown without moving the module to the CPU: its parameters are the shards and blocks dpar
        placed, and ``to``/``cpu`` cannot swap a parameter the compiled graphs still reference."""
        from lightning_fabric.utilities.optimizer import _optimizers_to_device

        self.model = self.lightning_module
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        with dpar.no_sync(self.lightning_module):
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the checkpoint loads into the placed model and the optimizers built for it

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored them

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # save_checkpoint writes the model through dpar.checkpoint

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # and the optimizer with it

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options: dpar.checkpoint writes it")
        path = self.broadcast(filepath)
        checkpoint.pop("state_dict", None)
        optimizer = _one_optimizer(self._plain_optimizers()) if checkpoint.pop("optimizer_states", None) is not None else None
        _save_directory(path, self.lightning_module, optimizer, checkpoint)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(checkpoint_path)
        return _load_directory(path, self.lightning_module, _one_optimizer(self._plain_optimizers()), weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # and the optimizer

    def _plain_optimizers(self) -> list[torch.optim.Optimizer]:
        return [getattr(o, "_optimizer", o) for o in self.optimizers]  # a LightningOptimizer wraps the torch one


class _CompiledSteps(_ForwardRedirection):
    """Lightning's forward redirection, in dpar's form: ``training_step`` (and the other steps) of the
    LightningModule, each compiled with the dpar backend, run in place of the wrapper's ``forward``.

    Lightning's own redirection patches ``forward`` and calls the wrapper; through a compiled wrapper that patch
    is a mutation Dynamo refuses (an ``AssertionError`` "already tracked for mutation" on torch 2.13, as soon as
    the step has no graph break). Compiling the bound step method traces the same code without the patch.
    """

    def __init__(self, options: Mapping[str, Any]) -> None:
        self._options = options
        self._steps: dict[str, Callable[..., Any]] = {}
        self._module: nn.Module | None = None

    def __call__(self, wrapper_module: nn.Module, original_module: Any, method_name: str, *args: Any, **kwargs: Any) -> Any:
        if self._module is not original_module:
            self._module, self._steps = original_module, {}
        if method_name not in self._steps:
            self._steps[method_name] = torch.compile(
                getattr(original_module, method_name), backend="dpar", options=dict(self._options))
        return self._steps[method_name](*args, **kwargs)


class _DparBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return dpar.no_sync(module) if enabled else nullcontext()


class DparFabricStrategy(FabricDDPStrategy):
    """Lightning Fabric's strategy for dpar: ``Fabric(strategy=DparFabricStrategy("fsdp"), devices=2)``.

    The keywords are ``DparStrategy``'s (``precision`` for ``precision_plugin``). ``fabric.setup(model, optimizer)`` parallelizes and compiles the model
    and points the optimizer at the placed parameters; ``fabric.no_backward_sync`` is ``dpar.no_sync``;
    ``fabric.save``/``fabric.load`` write and read a directory through ``dpar.checkpoint``.
    """

    def __init__(
        self, strategy: str = "fsdp", *, options: Mapping[str, Any] | None = None,
        example_inputs: Sequence[Any] | None = None, accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
        checkpoint_io: Any = None, precision: Any = None, process_group_backend: str | None = None,
        start_method: str = "popen", **parallelize_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
            start_method=start_method,
        )
        if strategy == "zero1":
            raise dpar.OptionsError(
                "zero1 under Fabric would train wrong silently: dpar's zero1 clears the whole gradients in the "
                "optimizer's own zero_grad, which it installs on the optimizer instance, and Fabric's optimizer "
                "wrapper calls the optimizer class's zero_grad, so the gradients would accumulate over steps. Use "
                "'zero2' (which also shards the optimizer state) with Fabric, or DparStrategy('zero1') with the Trainer"
            )
        self.dpar_strategy = strategy
        self._options = dict(options or {})
        self._example_inputs = example_inputs
        self._parallelize_kwargs = parallelize_kwargs
        self._backward_sync_control = _DparBackwardSyncControl()

    def setup_module(self, module: nn.Module) -> nn.Module:
        return _place(module, self.dpar_strategy, self._options, self._example_inputs, self._parallelize_kwargs)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None,
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        before = _parameter_names(module)
        compiled = self.setup_module(module)
        for optimizer in optimizers:
            _point_at_placed(module, optimizer, before)
        return compiled, optimizers, scheduler

    def clip_gradients_norm(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """``fabric.clip_gradients``: by dpar's global norm (torch's reads each rank's tensor-parallel blocks alone)."""
        self.precision.unscale_gradients(optimizer)
        norm = dpar.clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is not finite ({norm.item()}); "
                               "pass error_if_nonfinite=False to clip anyway")
        return norm

    def save_checkpoint(
        self, path: str | os.PathLike[str], state: dict[str, Any], storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if storage_options is not None or filter:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter")
        module, optimizer, rest = _split_state(state)
        _save_directory(self.broadcast(path), module, optimizer, rest)

    def load_checkpoint(
        self, path: str | os.PathLike[str], state: Any = None, strict: bool = True, weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            raise TypeError(
                f"{type(self).__name__}.load_checkpoint loads into the objects it is given: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        module, optimizer, _ = _split_state(state)
        rest = _load_directory(self.broadcast(path), module, optimizer, weights_only)
        missing = [k for k in state if k not in rest and not isinstance(state[k], (nn.Module, torch.optim.Optimizer))]
        if strict and missing:
            raise KeyError(f"the checkpoint at {path} holds no {missing[0]!r}; fabric.load(..., strict=False) skips it")
        for key in list(state):
            if key in rest:
                state[key] = rest.pop(key)
        return rest


def _split_state(state: Mapping[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer | None, dict[str, Any]]:
    """Fabric's ``state``: its one module, at most one optimizer, and the rest."""
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    if len(modules) != 1:
        raise dpar.OptionsError(
            f"dpar.checkpoint saves one parallelized model with its optimizer; this state holds {len(modules)} "
            "modules: save each model with its own fabric.save"
        )
    optimizer = _one_optimizer([v for v in state.values() if isinstance(v, torch.optim.Optimizer)])
    rest = {k: v for k, v in state.items() if not isinstance(v, (nn.Module, torch.optim.Optimizer))}
    return modules[0], optimizer, rest
