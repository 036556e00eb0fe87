"""``dpar.explain``: the inspector's report, with each strategy's model placed by ``dpar.parallelize``.

The inspector (``dpar.inspect``) sits below the api and does not import it; this is where the api
hands it the functions that place a model (``dpar.parallelize``) and cut it into stages (``dpar.pipeline``).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch

from dpar.core.errors import OptionsError
from dpar.inspect.explain import explain as _explain
from dpar.pipelining import pipeline
from dpar.placement import activation_policy, parallelize

if TYPE_CHECKING:
    from dpar.inspect.pipeline import PipelineReport
    from dpar.inspect.report import Report
    from dpar.planner.plan import Plan


@functools.wraps(_explain)
def explain(
    model: torch.nn.Module, example_inputs: Any, *, activation_checkpointing: Any = None, plan: Plan | None = None,
    **kwargs: Any,
) -> Report | PipelineReport:
    """``dpar.inspect``'s ``explain``; ``activation_checkpointing``, ``same_batch_in_cp_group`` and
    ``attention_exchange`` as ``dpar.parallelize`` takes them (``activation_checkpointing`` under ddp too;
    under ``strategy="pipeline"`` as ``dpar.pipeline`` does);
    ``plan`` (from ``dpar.plan``) placed as ``parallelize(plan=plan)`` places it, on its mesh's ranks, instead of a
    strategy by name (``example_inputs``: one rank's slice)."""
    place = parallelize
    if kwargs.pop("same_batch_in_cp_group", False):  # one batch per cp group: the activations of its chunks only
        place = functools.partial(place, same_batch_in_cp_group=True)
    exchange = kwargs.pop("attention_exchange", None)
    if exchange is not None:
        place = functools.partial(place, attention_exchange=exchange)
    if plan is not None:
        world = math.prod(plan.mesh_shape)
        if kwargs.setdefault("world_size", world) != world or kwargs.setdefault("strategy", "auto") != "auto":
            raise OptionsError(f"explain: plan= gives the strategy ({plan.strategy}) and the world ({world} ranks); "
                               f"drop strategy= and world_size= (got {kwargs['strategy']!r}, {kwargs['world_size']})")
        place = functools.partial(parallelize, plan=plan)
    if kwargs.get("strategy") == "pipeline":  # the stages' blocks recompute as dpar.pipeline runs them
        kwargs["activations"] = activation_policy(model, activation_checkpointing)
    elif activation_checkpointing is not None:
        place = functools.partial(place, activation_checkpointing=activation_checkpointing)
        place.places_ddp = True  # type: ignore[attr-defined]
    return _explain(model, example_inputs, parallelize=place, build_pipeline=pipeline, **kwargs)


__all__ = ["explain"]
