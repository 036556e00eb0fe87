"""The graphs of one Dynamo capture, compiled again for each model that calls them.

[Note: one capture, several models]
Dynamo caches compiled code by the code object and its guards, and with parameters as graph inputs it
guards on their metadata (shape, dtype, stride), not on which model holds them. Two models of one class
with parameters of the same shapes therefore share the graphs the backend compiled for the first one,
whatever plan the second was given: a second model under another strategy, or the same one with another
attention exchange, or a plain model beside a parallelized one, would run the first one's communication
on its own parameters, without an error. So the callable the backend returns remembers the model its
graphs were compiled for and, at each call, finds the model its parameter inputs belong to: the same
model runs on (one dict lookup), another is compiled for from the same captured graph, once, and kept
beside. Nothing here holds a parameter (or a weak reference to one, which ``swap_tensors`` refuses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from dpar.compiler.graph_utils import copy_graph_module
from dpar.core import model_state
from dpar.core.model_state import ModelState

Compile = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]


@dataclasses.dataclass(frozen=True)
class _Source:
    """What a placeholder's ``grapharg`` tells the backend (``capture._source_name``): Dynamo's own holds a weak
    reference to the live parameter, which ``torch.utils.swap_tensors`` refuses while it exists."""

    source: object


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph and meta that the passes run on ``gm`` leave as captured (node meta copied, not shared),
    holding no reference to the tensors it was captured with."""
    copy = copy_graph_module(gm)
    for node in copy.graph.nodes:
        if "grapharg" in node.meta:
            node.meta["grapharg"] = _Source(getattr(node.meta["grapharg"], "source", None))
    copy.meta = dict(gm.meta)
    return copy


def _owner(tensor: torch.Tensor) -> ModelState | None:
    return model_state.owners_of([tensor])[0]


class PerModel:
    """Calls the graphs compiled for the model that owns the parameter at ``position`` of the arguments (see the Note)."""

    def __init__(self, captured: fx.GraphModule, compile_graphs: Compile, position: int, compiled: Callable[..., Any],
                 parameter: torch.Tensor) -> None:
        """``compiled``: the graphs compiled for the model holding ``parameter``, the argument at ``position``."""
        self.captured, self.compile_graphs, self.position = captured, compile_graphs, position
        owner = _owner(parameter)
        self.compiled: dict[int, tuple[ModelState | None, Callable[..., Any]]] = {id(owner): (owner, compiled)}
        self.last, self.plain_id = owner, id(parameter)  # the owner of the latest call; a plain model's parameter id

    def _owner_of(self, tensor: torch.Tensor) -> ModelState | None:
        """The model state owning ``tensor``: the latest call's where its map still knows it, else looked up."""
        if self.last is not None and self.last.cached_names_of(tensor):
            return self.last
        if self.last is None and id(tensor) == self.plain_id and not any(
                s.cached_names_of(tensor) for s in model_state.states()):
            return None
        owner = _owner(tensor)
        self.plain_id = id(tensor) if owner is None else self.plain_id
        return owner

    def __call__(self, *args: Any) -> Any:
        owner = self._owner_of(args[self.position])
        found = self.compiled.get(id(owner))
        if found is None or found[0] is not owner:  # another model, or a state gone whose id was reused
            found = (owner, self.compile_graphs(graph_copy(self.captured), list(args)))
            self.compiled[id(owner)] = found
        self.last = owner
        return found[1](*args)
