"""A parallelized model that trains without its graphs reaching dpar is refused at its first forward.

[Note: a model that never reaches the backend]
dpar's gradient synchronisation (and under the sharded strategies, the gathers) is communication inserted
into the graphs Dynamo hands the backend. A model whose training forward runs eagerly, because
``torch.compile`` was never called or because Dynamo compiled nothing (``nn.Module.compile`` on an
``nn.Sequential``: Dynamo skips a ``_call_impl`` frame that is torch's code through and through), would
train each rank on its own gradients with no error. ``parallelize`` registers a forward pre-hook on the
model: under Dynamo ``torch.compiler.is_compiling()`` is a constant and the hook traces to nothing (graphs
unchanged); run eagerly with autograd recording, in training mode, on more than one rank, it raises
``NotCompiledError``. Evaluation (``torch.no_grad()``, ``model.eval()``) may run eagerly. Tracing on fake or
meta tensors (dpar's own planning and inspection) is left alone. Having a hook also makes
``nn.Module.compile`` trace an ``nn.Sequential`` (its ``_call_impl`` takes the path that calls hooks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dpar.core import model_state
from dpar.core.errors import NotCompiledError
from dpar.core.torch_internals import detect_fake_mode


def refuse_eager_training(model: nn.Module, strategy: str) -> None:
    """Register the check of [Note: a model that never reaches the backend] on ``model`` (once)."""
    state = model_state.state_of(model, create=True)
    if state.model_fact("eager guard") is not None:
        return

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not module.training:
            return
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        tensors = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
        if any(t.is_meta for t in tensors) or detect_fake_mode(tensors) is not None:
            return
        raise NotCompiledError(
            f"{type(module).__name__}, parallelized for {strategy!r}, ran a training forward outside dpar's compiled "
            "graphs: dpar's communication is in those graphs, so each rank would train on its own gradients. Call "
            "the model returned by torch.compile(model, backend='dpar') (nn.Module.compile(backend='dpar') compiles "
            "nothing for a module whose forward is torch's own, such as nn.Sequential). Evaluation may run eagerly "
            "under torch.no_grad() or model.eval()."
        )

    state.set_model_fact("eager guard", model.register_forward_pre_hook(check, with_kwargs=True))
