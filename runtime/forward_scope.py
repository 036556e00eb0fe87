"""The root's forward, run eagerly, is where parallelized attributes read whole parameters.

See [Note: a parameter is its parameter] in core/model_state.py: a swapped module's own ``forward`` enters the
scope for itself; these hooks enter it for the whole model, so that a forward reading another module's parameter
(a tied head written as ``F.linear(x, self.embed.weight)``) reads it whole too. Under Dynamo both hooks trace to
nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from dpar.core import model_state


def count_eager_forwards(model: nn.Module) -> None:
    """Register, once, the root hooks that count ``model``'s eager forwards on its ``ModelState``."""
    state = model_state.state_of(model, create=True)
    if state.model_fact("forward scope") is not None:
        return

    def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.compiler.is_compiling():
            state.eager_forwards += 1

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not torch.compiler.is_compiling():
            state.eager_forwards -= 1

    # First in, and called also when the forward or a later pre-hook raises: the count always comes back.
    handles = (model.register_forward_pre_hook(enter, prepend=True),
               model.register_forward_hook(leave, always_call=True))
    state.set_model_fact("forward scope", handles)
