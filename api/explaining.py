"""``dpar.explain``: the inspector's report, with each strategy's model placed by ``dpar.parallelize``.

The inspector (``dpar.inspect``) sits below the api and does not import it; this is where the api
hands it the one function that places a model.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from dpar.inspect.explain import explain as _explain
from dpar.placement import parallelize

if TYPE_CHECKING:
    from dpar.inspect.pipeline import PipelineReport
    from dpar.inspect.report import Report


@functools.wraps(_explain)
def explain(model: torch.nn.Module, example_inputs: Any, **kwargs: Any) -> Report | PipelineReport:
    return _explain(model, example_inputs, parallelize=parallelize, **kwargs)


__all__ = ["explain"]
