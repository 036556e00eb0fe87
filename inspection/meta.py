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

import torch.fx as fx
import torch.nn.functional as F

from dpar.compiler.costs import flash_attention
from dpar.core.torch_internals import python_meta_kernels_lifted


def is_meta(model: torch.nn.Module, example_inputs: Any = ()) -> bool:
    """Whether any parameter, buffer or input tensor lives on the meta device."""
    tensors = [*model.parameters(), *model.buffers()]
    inputs = example_inputs.values() if isinstance(example_inputs, dict) else (
        example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    )
    tensors += [t for t in inputs if isinstance(t, torch.Tensor)]
    return any(t.is_meta for t in tensors)


@contextlib.contextmanager
def differentiable_on_meta() -> Iterator[None]:
    """See [Note: meta models lose their gradients under the python dispatcher]."""
    with python_meta_kernels_lifted():
        yield


def attention_fused(gm: fx.GraphModule) -> fx.GraphModule:
    """[Note: attention on meta]
    On a meta tensor ``F.scaled_dot_product_attention`` finds no fused kernel (its choice of backend is
    made per device, and meta has none) and falls to its math path: Q·Kᵀ written as an fp32 score matrix
    (B·H·S² elements), a softmax, P·V, and the backward saving the scores. No device dpar prices runs
    that: CUDA (flash / memory-efficient) and the CPU (``_scaled_dot_product_flash_attention_for_cpu``) run
    one kernel that saves the output and a logsumexp per row (B·H·S) and recomputes the scores in its
    backward. On Llama-3-8B (one row of 2048 tokens) the math path keeps 4·32·2048² bytes = 537 MB of
    scores a layer, and its step on 64 H100s (fsdp) was priced 398.1 ms of compute, 337.5 ms with the
    fused kernel. So a model traced on meta has each SDPA call of its Dynamo graph replaced by that
    kernel (``compiler.costs.flash_attention``: one forward node and one backward node, their FLOPs by
    ``compiler.costs.node_flops``), which is what the planner asks autograd about too. A call asking for GQA
    (``enable_gqa``) or a dropout is left as it is (the CPU kernel does not take the first; the second
    draws randoms).
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
            continue
        gqa = node.kwargs.get("enable_gqa") or (len(node.args) > 7 and node.args[7])
        if gqa or (len(node.args) > 4 and node.args[4]) or node.kwargs.get("dropout_p"):
            continue
        node.target = flash_attention
        changed = True
    if changed:
        gm.recompile()
    return gm
