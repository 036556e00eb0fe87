"""dpar under Hugging Face Accelerate: an ``Accelerator`` that leaves the gradient reduction to dpar.

[Note: why Accelerate must not wrap a dpar model]
``Accelerator.prepare`` wraps every trainable model of a multi-process run in torch's
``DistributedDataParallel``. A dpar-compiled model already reduces its gradients inside its graphs, so
DDP around it reduces each gradient a second time (dpar refuses that at the first graph with
``WrappedTwiceError``), and under the sharded strategies (``zero2``, ``fsdp``, ``tp``) Accelerate refuses
the ``DTensor`` parameters outright. Its ``dynamo_plugin`` cannot compile with dpar either: it accepts only
the backend names of its ``DynamoBackend`` enum (``"dpar"`` is ``ValueError: 'DPAR' is not a valid
DynamoBackend``). ``DparAccelerator`` overrides two public methods: ``prepare_model`` compiles the model with
``backend="dpar"`` and wraps nothing (what ``prepare_model(..., evaluation_mode=True)`` does: mixed
precision only), and ``no_sync`` (which ``accumulate`` enters on the micro-batches that do not step) is
``dpar.no_sync``. Data loaders and optimizers are prepared as Accelerate always does: each rank gets its
own slice of every batch, the contract of every dpar strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import accelerate
import torch
import torch.nn as nn

import dpar


def compile_with_dpar(model: nn.Module, options: dict[str, Any] | None) -> nn.Module:
    """``torch.compile(model, backend="dpar", options=options)``; a model torch.compile already wrapped is refused,
    since its backend cannot be read back and any other backend would train each rank on its own."""
    wrapped = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    if wrapped is not None:
        raise dpar.OptionsError(
            f"{type(wrapped).__name__} is already wrapped by torch.compile: pass the model itself "
            "(after dpar.parallelize, if you use a strategy) and give the backend's options as compile_options={...}; "
            "it is compiled with backend='dpar' here"
        )
    return torch.compile(model, backend="dpar", options=options)


class DparAccelerator(accelerate.Accelerator):
    """An ``Accelerator`` whose models dpar parallelizes: compiled with ``backend="dpar"``, never wrapped in DDP.

    ``compile_options`` go to ``torch.compile(..., options=...)``. See [Note: why Accelerate must not wrap a
    dpar model].
    """

    def __init__(self, *args: Any, compile_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compile_options = compile_options

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        return compile_with_dpar(prepared, self.compile_options)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        self.unscale_gradients()
        return dpar.clip_grad_norm_(parameters, max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        with dpar.no_sync(model):
            yield

    def save_state(self, *args: Any, **kwargs: Any) -> None:
        raise _refused_state("save_state", "save")

    def load_state(self, *args: Any, **kwargs: Any) -> None:
        raise _refused_state("load_state", "load")


def _refused_state(method: str, verb: str) -> dpar.OptionsError:
    """Accelerate saves every optimizer's state from rank 0 alone: under zero1, zero2, fsdp and tp that is one
    rank's part, which a resume would load on every rank."""
    return dpar.OptionsError(
        f"DparAccelerator.{method} would keep only rank 0's part of sharded optimizer state: call "
        f"dpar.checkpoint.{verb}(model, optimizer, path) on every rank (it {verb}s every rank's shards), and "
        "keep the scheduler's state_dict() beside it"
    )
