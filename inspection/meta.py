"""Tracing a model built on the meta device: no storage, and every gradient still in the graph.

[Note: meta models lose their gradients under the python dispatcher]
``torch._meta_registrations.activate_meta`` registers a Python ``Meta`` kernel for
every operator in the decomposition tables, CompositeImplicitAutograd ones
included (``aten.nll_loss``, ``aten.dropout``, ``aten.var``, ``aten.where`` ...).
AOTAutograd traces the joint graph with the Python dispatcher on; there,
``resolve_key(op, AutogradMeta)`` sees that Python ``Meta`` kernel as a backend
kernel, skips the CompositeImplicitAutograd decomposition (which autograd would
have differentiated) and falls to the autograd-not-implemented fallback. The op
then has no ``grad_fn``, and everything before it gets no gradient: on a model
that ends in ``cross_entropy`` the backward graph returns ``None`` for every
parameter and data parallelism adds no collective, silently. On a real device
(cpu, cuda) the backend kernel is the device's, not ``Meta``, and nothing is lost.

``differentiable_on_meta`` lifts those Python ``Meta`` kernels for the time of
one inspection: a CompositeImplicitAutograd op then decomposes before autograd
as on any device, into ops that have meta kernels of their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dpar.core.torch_internals import python_meta_kernels_lifted


@contextlib.contextmanager
def differentiable_on_meta() -> Iterator[None]:
    """See [Note: meta models lose their gradients under the python dispatcher]."""
    with python_meta_kernels_lifted():
        yield
