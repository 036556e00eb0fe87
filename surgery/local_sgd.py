"""Local SGD's surgery: the model's averaging period attached to it (runtime/local_sgd.py reads it each forward)."""

from __future__ import annotations

import torch.nn as nn

from dpar.core import model_state
from dpar.core.facts import LOCAL_SGD_PERIOD, OuterSGD, Period

__all__ = ["OuterSGD", "Period", "attach"]


def attach(period: Period, model: nn.Module) -> None:
    """Where ``model`` is in its averaging period, read by the backend and saved with checkpoints."""
    model_state.state_of(model, create=True).set_model_fact(LOCAL_SGD_PERIOD, period)
