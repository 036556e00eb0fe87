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
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition

from dpar.core.torch_internals import aot_autograd, functorch_config, inductor

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
STAGE_COMPILERS = ("aot_eager", "inductor")


class GraphRole(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    INFERENCE = "inference"


Lower = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]


class GraphHook(Protocol):
    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower
    ) -> Callable[..., Any]: ...


JointPass = Callable[[fx.GraphModule], fx.GraphModule]

JOINT_INPUTS_KEY = "dpar_joint_inputs"
"""``gm.meta`` key set on a joint graph before its passes: (number of primals, number of forward
outputs), from AOTAutograd's partitioner arguments rather than from placeholder names."""


PARTITION_KWARGS_KEY = "dpar_partition_kwargs"
"""``gm.meta`` key set on a joint graph before its passes: the keywords AOTAutograd calls the partitioner
with, so that a pass can partition a copy as the real partition will (passes/recompute.py's budget)."""


FLAT_INPUT_KEY = "dpar_flat_input"
"""``node.meta`` key on a graph input: its position among AOTAutograd's flat forward inputs. Set by
position on the joint graph's primals and on forward and inference graphs (whose inputs are the flat
inputs in order); the partitioner shares a placeholder's ``meta`` with the joint's, so a parameter
the backward saves keeps it there too."""

TANGENT_KEY = "dpar_tangent"
"""``node.meta`` key on the joint graph's tangent inputs (the gradients flowing into the backward)."""


def tag_flat_inputs(gm: fx.GraphModule, count: int | None = None) -> fx.GraphModule:
    """Tag the first ``count`` (default: every) placeholders with their position."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position, node in enumerate(placeholders[:count]):
        node.meta.setdefault(FLAT_INPUT_KEY, position)
    return gm


def flat_inputs(graph: fx.Graph) -> dict[int, fx.Node]:
    """Position among the flat forward inputs -> this graph's placeholder for it (see FLAT_INPUT_KEY)."""
    return {n.meta[FLAT_INPUT_KEY]: n for n in graph.nodes if n.op == "placeholder" and FLAT_INPUT_KEY in n.meta}


def tangents(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder" and n.meta.get(TANGENT_KEY)]


class _TakesInputList(fx.CodeGen):
    """Code that takes its inputs as one list and empties it, so that each input dies after its last use.

    [Note: a backward frees what it saved as it goes]
    AOTAutograd calls a compiled backward with one list of the saved activations and gradients and
    keeps no other reference to them, so that the graph can free each after its last reader, as the
    generated code does for its own values (``x = None``). ``make_boxed_func(gm.forward)`` calls
    ``forward(*args)``: the list, and the call's argument tuple, hold every saved activation until the
    backward returns, which measured ~25 % above the step's peak activation memory for an HF Llama
    (benchmarks/measured_vs_modelled.py). This code unpacks the list into locals and clears it.
    """

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, **kwargs: Any) -> str:
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        lines = [f"def {self._func_name}(self, inputs){maybe_return_annotation}:"]
        if names:
            lines += [f"    {', '.join(names)}, = inputs", "    inputs.clear()"]
        return "\n".join(lines)


def _python(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The graph's Python code, boxed: see [Note: a backward frees what it saved as it goes]."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(_TakesInputList())
    taking = fx.GraphModule(gm, graph)

    def run(args: list[Any]) -> Any:
        return taking(args if isinstance(args, list) else list(args))  # a caller's tuple is not emptied

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _interpreted(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Node by node through fx.Interpreter: slow, but every op can be stepped through."""
    return make_boxed_func(lambda *args: fx.Interpreter(gm).run(*args))


def _recorded(joint: fx.GraphModule, inputs: Sequence[Any], kwargs: dict[str, Any]) -> fx.GraphModule:
    """The joint graph with its calling convention in ``meta``: passes read it there, not from node names."""
    primals, _tangents = inputs
    joint.meta[JOINT_INPUTS_KEY] = (len(primals), kwargs["num_fwd_outputs"])
    joint.meta[PARTITION_KWARGS_KEY] = dict(kwargs)
    tag_flat_inputs(joint, len(primals))
    for node in [n for n in joint.graph.nodes if n.op == "placeholder"][len(primals):]:
        node.meta[TANGENT_KEY] = True
    return joint


def _tagged(gm: fx.GraphModule, role: GraphRole) -> fx.GraphModule:
    """A forward or inference graph's inputs are the flat forward inputs, in order."""
    return gm if role is GraphRole.BACKWARD else tag_flat_inputs(gm)


def compile_graphs(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    compiler: str,
    hook: GraphHook,
    joint_pass: JointPass | None = None,
) -> Callable[..., Any]:
    """Capture forward/backward with AOTAutograd and route every graph through ``hook``.

    ``joint_pass`` edits the joint graph before the min-cut partitioner splits
    it (to decide what the backward recomputes rather than saves).
    """
    if compiler == "inductor":
        return _compile_inductor(gm, example_inputs, hook, joint_pass)
    lower = _python if compiler == "aot_eager" else _interpreted

    def role_compiler(role: GraphRole) -> Callable[..., Any]:
        return lambda g, ex: hook(_tagged(g, role), ex, role, lower)

    partition = {}
    if joint_pass is not None:
        partition["partition_fn"] = lambda joint, inputs, **kw: min_cut_rematerialization_partition(
            joint_pass(_recorded(joint, inputs, kw)), inputs, **kw
        )
    return aot_autograd(
        fw_compiler=role_compiler(GraphRole.FORWARD),
        bw_compiler=role_compiler(GraphRole.BACKWARD),
        inference_compiler=role_compiler(GraphRole.INFERENCE),
        **partition,
    )(gm, example_inputs)


def _compile_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], hook: GraphHook, joint_pass: JointPass | None
) -> Callable[..., Any]:
    inductor_ = inductor()

    def inner_compile(g: fx.GraphModule, ex: Sequence[Any], **kwargs: Any) -> Any:
        kwargs.pop("get_decomp_fn", None)
        if kwargs.get("is_backward"):
            role = GraphRole.BACKWARD
        elif kwargs.get("is_inference"):
            role = GraphRole.INFERENCE
        else:
            role = GraphRole.FORWARD

        def lower(graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
            return inductor_.compile_fx_inner(graph, inputs, **kwargs)

        return hook(_tagged(g, role), ex, role, lower)

    class JointThenMinCut(inductor_.CustomPartitionerFn):
        def __call__(self, joint: fx.GraphModule, inputs: Sequence[object], **kwargs: Any) -> Any:
            return min_cut_rematerialization_partition(joint_pass(_recorded(joint, inputs, kwargs)), inputs, **kwargs)

        def uuid(self) -> Any:
            return None  # not cacheable: the tags depend on this model's sharding

    # The partitioner is specific to this model's sharding and cannot key a cache entry.
    patches = {"custom_partitioner_fn": JointThenMinCut(), "fx_graph_cache": False} if joint_pass is not None else {}
    # A cached artifact would skip the hooks, and with them the runtime that dispatches variants.
    with functorch_config().patch(enable_autograd_cache=False), inductor_.config.patch(patches):
        return inductor_.compile_fx(gm, example_inputs, inner_compile=inner_compile)


def lower_stage_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Inductor's code for one pipeline stage graph.

    [Note: compiled pipeline stages]
    A stage's F, B, I and W graphs (and their data-parallel variants: the fsdp gather, the last
    backward's bucketed all-reduce or reduce-scatter) are ATen graphs that already are the backward
    (compiler/pipeline_parallel/stage_graphs.py), so each is lowered as an inference graph, under
    ``no_grad``, at its first run with that run's tensors (a model born on meta is on its device by
    then). The schedule's order of graphs and point-to-point transfers is the executor's and stays
    as it is; each graph's own collectives (tensor parallel, the dp buckets) are lowered with it.
    Inductor takes and returns flat tensors: values cross between F, I and W as tensors, never as the
    tuple of a multi-output node (``_with_items`` in stage_graphs.py). torch.distributed.pipelining
    refuses compiled stages under its zero-bubble schedules; here I and W are graphs of their own, so
    they compile like any other.
    """
    with torch.no_grad():
        return inductor().compile_fx(gm, list(example_inputs))
