"""A stage's forward, backward, input-gradient and weight-gradient graphs, cut from one joint graph.

[Note: splitting a stage's backward into I and W]
Each stage graph is traced once more with its backward (``make_fx`` over ``autograd.grad``), which
gives one joint graph from (parameters, inputs, output gradients) to (outputs, input gradients,
parameter gradients). dpar cuts that joint graph itself, by data dependence alone:

- *forward*: what the outputs need; it also returns the *saved* values, the forward values the
  backward reads (the default partitioner's choice: nothing is recomputed), or, under an activation
  policy, see [Note: activation checkpointing inside a pipeline stage].
- *backward input* (I): what the input gradients need, from the saved values and the output
  gradients. It also returns the *stash*: its own values that the weight gradients read too
  (for ``y = x @ W``, the gradient of ``y`` feeds both ``dx`` and ``dW``).
- *backward weight* (W): the rest, the parameter gradients, from the saved values and the stash.
- *backward* (B): I and W as one graph, for schedules that do not split them.

So I is exactly the critical path between stages and W is work no other rank waits for: a
zero-bubble schedule moves W into what would otherwise be bubbles. I and W together compute
each node once, the same nodes as B.

[Note: activation checkpointing inside a pipeline stage]
A stage's cut runs no partitioner, so the plan's per-block policy is applied by the cut itself, from the
same tags ``tag_recompute`` gives AOTAutograd's joint graph (``tag_stage_recompute``; the trace keeps
each node's ``nn_module_stack`` from the captured graph, which names its block). Walking back from the
gradients, a forward node of a recomputing block tagged prefer-recompute is computed again in the
backward (B, or I), and its inputs are walked in turn; any other forward value is saved. A tagged node
read by a forward node outside its block instance (the next block, the final norm) is saved too: the
block's output, as ``torch.utils.checkpoint`` leaves it to its reader. So ``full`` saves each block's
input and ``selective`` its matmul and attention outputs; collectives and random ops are never
recomputed (must-save). The recomputation reads the parameters the backward already holds (under fsdp
the one gather before B serves both), and I stashes what it recomputed that W reads.
A budget (``ActivationPolicy.budget_bytes``) is per stage and micro-batch: the bytes its forward saves
(``saved_activation_bytes``, the cost model's count: distinct storages, received activations included).
The cut walks ``recompute.ladder`` over the stage's blocks as ``fit_budget`` does for a whole graph
(keep, then one block more selective, then full), each rung tagged on a copy and cut, and keeps the
first that fits; none does: a named error with the smallest figure.

[Note: a buffer a stage's forward accumulates into]
A forward may count into a buffer under ``torch.no_grad()`` (torchtitan's MoE: ``tokens_per_expert.add_(...)``,
read by its trainer to balance the experts). The write is no ancestor of the outputs, so a cut by data dependence
alone would drop it: F keeps every in-place ``add_`` into a buffer and what it reads, and runs it once per
micro-batch, so the buffer ends the step holding the sum over the stage's micro-batches, which is the sum over its
pipeline's batch, as one forward of that batch would leave it. Any other in-place write into a buffer (``copy_``,
``mul_``, a running average) gives a different value per micro-batch than per batch: refused by name.

[Note: tensor parallel inside a pipeline stage]
Under a mesh with a ``tp`` dimension the stage's split parameters arrive as this rank's blocks, and the
joint graph reads each through ``dpar::tensor_parallel_weight`` (the marker ``dpar.parallelize``'s
modules read them through: see [Note: how a tensor-parallel parameter reaches the graph]), so ``make_fx``
records the marker and, from ``autograd.grad``, its gradient marker. The tensor-parallel pass
(``tensor_parallel_pass``: propagation, then localization) then runs on that joint graph as it does on
AOTAutograd's, before it is cut: F, B, I and W each get the collectives of their own nodes, so every
schedule runs them where it runs the node. The joint graph's outputs come out replicated over ``tp``
(the carried activations, the input gradients, the loss), parameter gradients as their parameter's
block; saved values between F and B stay as propagation placed them, each rank's own.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call

from dpar.compiler.graph_utils import copy_graph_module
from dpar.compiler.memory import Live, liveness, storages_of
from dpar.compiler.passes.recompute import (
    GRAPH_ID_KEY, block_path, ladder, recomputed_in_backward, tag_stage_recompute,
)
from dpar.compiler.passes.tensor_parallel import tensor_parallel_pass
from dpar.compiler.pipeline_parallel.split import written_in_place
from dpar.compiler.propagation.propagate import MeshDim
from dpar.core.errors import ActivationPolicyError, OptionsError
from dpar.core.facts import TensorParallelSpec
from dpar.core.pipeline_program import Stage, StageGraphs
from dpar.core.plan import KEEP_ACTIVATIONS, ActivationPolicy
from dpar.runtime.tensor_parallel import whole_parameter


def _ancestors(roots: Iterable[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in stop:
            stack.extend(node.all_input_nodes)
    return seen


def _with_items(region: set[fx.Node]) -> set[fx.Node]:
    """``region`` and the items read out of its multi-output nodes, so that a value crosses from one graph to
    the next as a tensor, never as a tuple (a compiler takes and returns flat tensors): attention's or the
    loss's second result, read by the backward only, is taken out where the node runs."""
    return region | {u for n in region for u in n.users if u.op == "call_function" and u.target is operator.getitem}


def extract_graph(
    joint: fx.GraphModule, inputs: Sequence[fx.Node], outputs: Sequence[fx.Node | None], effects: Sequence[fx.Node] = (),
) -> fx.GraphModule:
    """The part of ``joint`` that computes ``outputs`` (and runs the in-place writes ``effects``) from ``inputs``,
    as its own graph module."""
    stop = set(inputs)
    needed = _ancestors([*(o for o in outputs if o is not None), *effects], stop)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in joint.graph.nodes:
        if node in needed and node not in env:
            if node.op == "placeholder":
                raise AssertionError(f"{node.name} is needed but is not an input of the extracted graph")
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[o] if o is not None else None for o in outputs))
    gm = fx.GraphModule(joint, graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


class _Interpreted(nn.Module):
    """A stage graph run node by node, so that the ops traced from each carry its ``nn_module_stack``
    (``fx_traceback.preserve_node_meta``): the block an activation policy names."""

    def __init__(self, graph: fx.GraphModule) -> None:
        super().__init__()
        self.graph = graph

    def forward(self, *args: torch.Tensor):  # noqa: ANN201 (the stage graph's outputs)
        return fx.Interpreter(self.graph).run(*args)


def _saved(roots: Sequence[fx.Node], forward: set[fx.Node], carried: set[fx.Node]) -> set[fx.Node]:
    """The forward values (and ``carried`` inputs) the backward reads, walking back from the gradients
    ``roots`` through what it computes, recomputed forward nodes included: [Note: activation
    checkpointing inside a pipeline stage]."""

    def recomputed(node: fx.Node) -> bool:
        block = node.meta.get(GRAPH_ID_KEY)
        return recomputed_in_backward(node) and all(
            u not in forward or u.meta.get(GRAPH_ID_KEY) == block for u in node.users)

    saved, seen = set(), set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            if node in carried:
                saved.add(node)
            continue
        if node in forward:
            if not recomputed(node):
                saved.add(node)
                continue
        stack.extend(node.all_input_nodes)
    return saved


def trace_stage(
    stage: Stage, state: dict[str, torch.Tensor], last: bool, batch: Sequence[torch.Tensor],
    splits: dict[str, TensorParallelSpec] | None = None, tp: MeshDim | None = None,
    activations: ActivationPolicy = KEEP_ACTIVATIONS,
) -> StageGraphs:
    """Trace ``stage``'s joint graph and cut it per [Note: splitting a stage's backward into I and W].

    ``state``: the model's parameters and buffers by name (tied ones under each name). ``splits`` (name ->
    spec, split parameters only) and ``tp``: see [Note: tensor parallel inside a pipeline stage].
    ``activations``: see [Note: activation checkpointing inside a pipeline stage]."""
    return _cut(_trace_joint(stage, state, last, batch, splits or {}, tp), activations)


def trace_stage_under(
    stage: Stage, state: dict[str, torch.Tensor], last: bool, batch: Sequence[torch.Tensor],
    policies: Sequence[ActivationPolicy],
) -> tuple[StageGraphs, ...]:
    """``trace_stage`` under each of ``policies``, from one trace (what a policy changes is the cut)."""
    joint = _trace_joint(stage, state, last, batch, {}, None)
    return tuple(_cut(dataclasses.replace(joint, traced=copy_graph_module(joint.traced)), policy)
                 for policy in policies)


@dataclasses.dataclass(frozen=True)
class _Joint:
    """A stage's joint graph: placeholders (parameters, buffers, batch inputs, carried, output gradients)
    to (outputs, input gradients, parameter gradients), and what the cut needs to know of it."""

    stage: Stage
    traced: fx.GraphModule
    names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    batch_inputs: int
    carried: int
    grad_inputs: tuple[int, ...]
    grad_outputs: tuple[int, ...]
    num_outputs: int


def _trace_joint(
    stage: Stage, state: dict[str, torch.Tensor], last: bool, batch: Sequence[torch.Tensor],
    splits: dict[str, TensorParallelSpec], tp: MeshDim | None,
) -> _Joint:
    graph_names = [name for name, _ in stage.graph.named_parameters(remove_duplicate=False)]
    buffer_graph_names = [name for name, _ in stage.graph.named_buffers(remove_duplicate=False)]
    names = tuple(name.removeprefix("model.") for name in graph_names)
    buffer_names = tuple(name.removeprefix("model.") for name in buffer_graph_names)
    params = [state[n] for n in names]
    buffers = [state[n] for n in buffer_names]
    grad_inputs = tuple(i for i, spec in enumerate(stage.carried_in) if spec.requires_grad)
    specs_out = stage.carried_out if not last else ()
    grad_outputs = (0,) if last else tuple(i for i, spec in enumerate(specs_out) if spec.requires_grad)
    num_outputs = 1 if last else len(specs_out)

    def read(name: str, value: torch.Tensor) -> torch.Tensor:
        spec = splits.get(name)
        return value if spec is None else whole_parameter(value, spec)

    def joint(param_values, buffer_values, batch_inputs, carried, output_grads):
        with torch.enable_grad():
            read_values = [read(n, v) for n, v in zip(names, param_values)]
            values = dict(zip(graph_names, read_values)) | dict(zip(buffer_graph_names, buffer_values))
            values = {f"graph.{name}": value for name, value in values.items()}
            out = functional_call(interpreted, values, (*batch_inputs, *carried))
            outs = (out,) if last else tuple(out)
            differentiable = [carried[i] for i in grad_inputs] + list(param_values)
            tracked = [(outs[i], g) for i, g in zip(grad_outputs, output_grads) if outs[i].requires_grad]
            grads = torch.autograd.grad(
                [o for o, _ in tracked], differentiable, [g for _, g in tracked], allow_unused=True
            ) if tracked else (None,) * len(differentiable)
        return outs, grads

    # The carried activations and output gradients live where the state does (a meta model: on meta).
    device = next((t.device for t in (*params, *buffers)), torch.device("cpu"))
    carried = [
        torch.zeros(spec.shape, dtype=spec.dtype, device=device, requires_grad=spec.requires_grad)
        for spec in stage.carried_in
    ]
    output_grads = (
        [torch.ones((), device=device)] if last
        else [torch.zeros(specs_out[i].shape, dtype=specs_out[i].dtype, device=device) for i in grad_outputs]
    )
    batch_inputs = [batch[i] for i in stage.batch_inputs]
    interpreted = _Interpreted(stage.graph)
    with fx_traceback.preserve_node_meta():
        traced = make_fx(joint, tracing_mode="fake")(params, buffers, batch_inputs, carried, output_grads)
    if tp is not None:
        traced = tensor_parallel_pass(traced, tp)
    return _Joint(stage, traced, names, buffer_names, len(batch_inputs), len(carried), grad_inputs, grad_outputs,
                  num_outputs)


def _cut(joint: _Joint, activations: ActivationPolicy) -> StageGraphs:
    traced, num_outputs, grad_inputs = joint.traced, joint.num_outputs, joint.grad_inputs
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    n_params = len(joint.names)
    n_p = n_params + len(joint.buffer_names)
    p_nodes = placeholders[:n_p]  # the state: parameters, then buffers
    x_nodes = placeholders[n_p:n_p + joint.batch_inputs + joint.carried]
    t_nodes = placeholders[n_p + joint.batch_inputs + joint.carried:]
    out_node = next(n for n in traced.graph.nodes if n.op == "output")
    flat = list(out_node.args[0])  # make_fx flattens (outputs, grads)
    outs, grads = flat[:num_outputs], flat[num_outputs:]
    input_grads = grads[: len(grad_inputs)]
    param_grads = grads[len(grad_inputs):]

    inputs = set(placeholders)
    accumulations = _buffer_accumulations(traced, dict(zip(p_nodes[n_params:], joint.buffer_names)))
    forward_region = _with_items(_ancestors([*outs, *accumulations], inputs) - inputs)
    present = [g for g in grads if g is not None]
    if activations.budget_bytes is not None:
        activations = _fit_budget(joint, forward_region, activations.budget_bytes)
    if activations.recomputes:
        tag_stage_recompute(traced, activations, forward_region)
    # Saved: forward values (the batch and carried inputs included) that the backward reads.
    saved_set = _saved(present, forward_region, set(x_nodes))
    boundary = inputs | saved_set  # the backward's region: what it computes from those
    grad_region = _ancestors(present, boundary) - boundary
    input_region = _with_items(_ancestors([g for g in input_grads if g is not None], boundary)) - boundary
    weight_region = grad_region - input_region

    def read_by(node: fx.Node, region: set[fx.Node], results: list) -> bool:
        return any(u in region for u in node.users) or any(node is r for r in results)

    saved = [n for n in traced.graph.nodes if n in saved_set]
    stash = [n for n in traced.graph.nodes if n in input_region and read_by(n, weight_region, param_grads)]

    forward = extract_graph(traced, p_nodes + x_nodes, outs + saved, effects=accumulations)
    backward = extract_graph(traced, p_nodes + saved + t_nodes, input_grads + param_grads)
    backward_input = extract_graph(traced, p_nodes + saved + t_nodes, input_grads + stash)
    backward_weight = extract_graph(traced, p_nodes + saved + t_nodes + stash, param_grads)
    return StageGraphs(
        stage=joint.stage,
        parameter_names=joint.names,
        buffer_names=joint.buffer_names,
        grad_inputs=grad_inputs,
        grad_outputs=joint.grad_outputs,
        num_outputs=num_outputs,
        num_saved=len(saved),
        num_stash=len(stash),
        forward=forward,
        backward=backward,
        backward_input=backward_input,
        backward_weight=backward_weight,
        activations=activations,
    )


def saved_activation_bytes(stage_graphs: StageGraphs) -> tuple[int, int]:
    """Bytes of the distinct storages the forward saves per micro-batch, received activations included (the
    parameters, the batch and views of them not), and of those the part computed from the batch and buffers
    alone (no parameter, nothing received): what the pipeline cost model holds and a budget counts."""
    forward = stage_graphs.forward
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    first_batch = len(stage_graphs.parameter_names) + len(stage_graphs.buffer_names)
    first_carried = first_batch + len(stage_graphs.stage.batch_inputs)
    carried = {n.name for n in placeholders[first_carried:]}
    live = liveness(forward, {}, carried, set(), exclude_outputs=False)
    learned = set(placeholders[:len(stage_graphs.parameter_names)]) | set(placeholders[first_carried:])
    for node in forward.graph.nodes:
        if any(a in learned for a in node.all_input_nodes):
            learned.add(node)
    saved = forward.graph.output_node().args[0][stage_graphs.num_outputs:]
    keys = {key for node in saved for key, _ in storages_of(node)}
    free = {key for node in saved if node not in learned for key, _ in storages_of(node)}
    held = {key: live.counted.get(key, Live()).total for key in keys}
    return sum(held.values()), sum(held[key] for key in free)


def _fit_budget(joint: _Joint, forward: set[fx.Node], budget_bytes: int) -> ActivationPolicy:
    """The first rung of ``recompute.ladder`` over the stage's blocks (keep everywhere, then one block more
    selective, then full) whose forward saves at most ``budget_bytes`` per micro-batch
    (``saved_activation_bytes``), each rung cut from a copy of the joint graph (a binary search: the saved
    bytes fall along the ladder)."""
    nodes = joint.traced.graph.nodes
    blocks = [b for b in dict.fromkeys(block_path(n) for n in nodes if n in forward and n.op == "call_function") if b]
    rungs = ladder(blocks)

    def saved_under(policy: ActivationPolicy) -> int:
        trial = dataclasses.replace(joint, traced=copy_graph_module(joint.traced))
        return saved_activation_bytes(_cut(trial, policy))[0]

    smallest = saved_under(rungs[-1])
    if smallest > budget_bytes:
        raise ActivationPolicyError(
            f"pipeline: an activation budget of {budget_bytes:,} bytes per micro-batch: stage {joint.stage.index}'s "
            f"forward saves {smallest:,} bytes even recomputing every block fully (block inputs, collectives' and "
            f"random ops' outputs, what runs outside blocks); raise the budget to at least {smallest:,}, or cut the "
            "model into more stages")
    low, high = 0, len(rungs) - 1
    while low < high:
        middle = (low + high) // 2
        if saved_under(rungs[middle]) <= budget_bytes:
            high = middle
        else:
            low = middle + 1
    return rungs[high]


def _buffer_accumulations(traced: fx.GraphModule, buffers: dict[fx.Node, str]) -> list[fx.Node]:
    """The in-place ``add_`` nodes into a buffer placeholder: [Note: a buffer a stage's forward accumulates into]."""
    accumulations = []
    for node in traced.graph.nodes:
        for value in written_in_place(node):
            if value not in buffers:
                continue
            if node.target is torch.ops.aten.add_.Tensor and node.kwargs.get("alpha", 1) == 1:
                accumulations.append(node)
                continue
            raise OptionsError(
                f"pipeline: the forward writes buffer {buffers[value]} in place with {node.target} (not an "
                "accumulation buffer.add_(...)): run once per micro-batch, it would end the step with another value "
                "than one forward of the batch gives. Update it outside the model's forward, or use "
                "parallelize(strategy='ddp')."
            )
    return accumulations


def retarget_device_pass(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """Every ``device=meta`` a trace on the meta device baked into ``gm`` (``arange``'s positions, a mask's
    ``scalar_tensor``) becomes ``device``, where the model's state now lives. See [Note: a pipeline born on meta]."""
    meta = torch.device("meta")

    def swap(value):  # noqa: ANN001, ANN202 (an fx argument of any kind)
        return device if isinstance(value, torch.device) and value == meta else value

    changed = False
    for node in gm.graph.nodes:
        args, kwargs = fx.node.map_aggregate(node.args, swap), fx.node.map_aggregate(node.kwargs, swap)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs, changed = args, kwargs, True
    if changed:
        gm.recompile()
    return gm
