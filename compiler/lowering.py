"""AOTAutograd capture and the inner compilers that turn post-pass graphs into code.

The backend supplies one hook per graph role; each hook runs dpar's passes and
then calls ``lower`` (the inner compiler) on the result, as often as it needs
variants of a graph.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

INNER_COMPILERS = ("inductor", "aot_eager", "eager")


class GraphRole(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    INFERENCE = "inference"


Lower = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]


class GraphHook(Protocol):
    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower
    ) -> Callable[..., Any]: ...


def _python(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    return make_boxed_func(gm.forward)


def _interpreted(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Node by node through fx.Interpreter: slow, but every op can be stepped through."""
    return make_boxed_func(lambda *args: fx.Interpreter(gm).run(*args))


def compile_graphs(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, compiler: str, hook: GraphHook
) -> Callable[..., Any]:
    """Capture forward/backward with AOTAutograd and route every graph through ``hook``."""
    if compiler == "inductor":
        return _compile_inductor(gm, example_inputs, hook)
    lower = _python if compiler == "aot_eager" else _interpreted

    def role_compiler(role: GraphRole) -> Callable[..., Any]:
        return lambda g, ex: hook(g, ex, role, lower)

    return aot_autograd(
        fw_compiler=role_compiler(GraphRole.FORWARD),
        bw_compiler=role_compiler(GraphRole.BACKWARD),
        inference_compiler=role_compiler(GraphRole.INFERENCE),
    )(gm, example_inputs)


def _compile_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], hook: GraphHook
) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(g: fx.GraphModule, ex: Sequence[Any], **kwargs: Any) -> Any:
        kwargs.pop("get_decomp_fn", None)
        if kwargs.get("is_backward"):
            role = GraphRole.BACKWARD
        elif kwargs.get("is_inference"):
            role = GraphRole.INFERENCE
        else:
            role = GraphRole.FORWARD

        def lower(graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
            return compile_fx_inner(graph, inputs, **kwargs)

        return hook(g, ex, role, lower)

    # A cached artifact would skip the hooks, and with them the runtime that dispatches variants.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)
