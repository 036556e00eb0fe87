"""``dpar.explain``: the inspector's report, with each strategy's model placed by ``dpar.parallelize``.

The inspector (``dpar.inspect``) sits below the api and does not import it; this is where the api
hands it the functions that place a model (``dpar.parallelize``) and cut it into stages (``dpar.pipeline``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from dpar.inspect.explain import explain as _explain
from dpar.pipelining import pipeline
from dpar.placement import parallelize

if TYPE_CHECKING:
    from dpar.inspect.pipeline import PipelineReport
    from dpar.inspect.report import Report


@functools.wraps(_explain)
def explain(
    model: torch.nn.Module, example_inputs: Any, *, activation_checkpointing: Any = None, **kwargs: Any
) -> Report | PipelineReport:
    """``dpar.inspect``'s ``explain``; ``activation_checkpointing`` as ``dpar.parallelize`` takes it (ddp included)."""
    place = parallelize
    if activation_checkpointing is not None:
        place = functools.partial(parallelize, activation_checkpointing=activation_checkpointing)
        place.places_ddp = True  # type: ignore[attr-defined]
    return _explain(model, example_inputs, parallelize=place, build_pipeline=pipeline, **kwargs)


__all__ = ["explain"]
