"""What one pipeline stage costs per micro-batch: forward time, activations held, bytes sent.

Shared by ``dpar.inspect.pipeline`` (the report) and ``dpar.planner.pipeline`` (the choice of pp),
so the two price a stage the same way.

[Note: the pipeline cost model]
A stage's graph (``split.split_stages``) is traced with its backward (``trace_stage``, on fake
tensors: nothing runs) and priced on one micro-batch:

- forward: the roofline of every node of the stage's forward graph (``costs.node_cost``, as every
  other ``dpar inspect`` timeline); the backward costs twice the forward, and for the zero-bubble
  schedules its input-gradient (I) and weight-gradient (W) halves one forward each; under an activation
  policy, plus the roofline of the forward ops each computes again (the nodes of B, I and W that carry
  the block ``tag_stage_recompute`` tagged);
- activations held per micro-batch, from its forward until its backward: the distinct storages of
  what the forward saves for the backward under the policy (the received activations included, the parameters and
  the batch not), by ``compiler/memory.py``'s liveness over the traced forward graph;
  Of these, ``free_activation_bytes`` are values the stage computes from the batch alone
  (RoPE's cos and sin): a stage of several blocks holds them once, not once per block;
- a send: the carried-out values' bytes, priced α + bytes·β (one point-to-point hop); the gradient
  going back is as large. The simulator takes one latency for every hop: the largest stage's.

Stages whose graphs are the same ops on the same shapes (the middle blocks of a deep model) cost
the same: each distinct graph is traced once (``cut_and_price``), so pricing 80 one-block stages
traces three.

State per rank is the model's own dtype: each parameter its bytes, a gradient as large, and
``OPTIMIZER_STATES[optimizer]`` tensors more (fp32 AdamW: 16 bytes per parameter, ZeRO's 16Ψ).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from dpar.core.pipeline_program import COMPUTE_OPS, Action, Op, Stage, StageGraphs, StageSplit
from dpar.compiler.pipeline_parallel.split import capture, split_stages
from dpar.compiler.pipeline_parallel.stage_graphs import saved_activation_bytes, trace_stage_under
from dpar.compiler.passes.recompute import BLOCK_KEY, policy_of
from dpar.compiler.collectives import COLLECTIVE_KINDS
from dpar.compiler.costs import DeviceSpec, link_time, node_cost, payload_bytes
from dpar.compiler.kernel_profile import with_kernel_times
from dpar.compiler.memory import OPTIMIZER_STATES
from dpar.core.errors import OptionsError
from dpar.core.plan import KEEP_ACTIVATIONS, ActivationPolicy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

BACKWARD_FACTORS = {Op.FORWARD: 1.0, Op.BACKWARD: 2.0, Op.BACKWARD_INPUT: 1.0, Op.BACKWARD_WEIGHT: 1.0}
"""Each compute action's cost in forwards of its stage (see [Note: the pipeline cost model])."""


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The default loss: cross-entropy of logits over their last dimension against integer targets; a model that
    returns a scalar computed its loss itself (a training step fed its targets, as ``dpar.plan`` takes it)."""
    if logits.dim() == 0:
        return logits
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def with_loss(example_inputs: Sequence[torch.Tensor], loss_fn: LossFn | None) -> tuple[tuple[torch.Tensor, ...], LossFn]:
    """``(*model_inputs, target)`` and the loss, as ``dpar.pipeline`` takes them.

    With ``loss_fn`` the last input is the target. Without one, every input goes to the model, its
    output is taken as logits and the target is shaped like the first input (the token ids: a
    language model's next-token targets have their shape; the costs depend on shapes only).
    """
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise OptionsError("pipeline inspection: example_inputs must be a tuple of tensors (positional inputs, "
                           "the batch in dim 0); keyword inputs are not supported by dpar.pipeline")
    if loss_fn is not None:
        if len(inputs) < 2:
            raise OptionsError("pipeline inspection: with loss_fn, example_inputs are (*model_inputs, target); "
                               "add the target as the last input, or drop loss_fn for next-token cross-entropy")
        return inputs, loss_fn
    return (*inputs, inputs[0]), token_cross_entropy


def micro_batch_of(inputs: Sequence[torch.Tensor], rows: int) -> tuple[torch.Tensor, ...]:
    """Every input at ``rows`` rows (repeated or cut in dim 0): only the shape is traced."""
    have = {x.shape[0] if x.dim() else None for x in inputs}
    if len(have) != 1 or None in have:
        raise OptionsError(f"pipeline inspection: every input needs the batch in dim 0 with the same number of rows; "
                           f"got shapes {[tuple(x.shape) for x in inputs]}")
    n = have.pop()
    return tuple(x.repeat(math.ceil(rows / n), *([1] * (x.dim() - 1)))[:rows] for x in inputs)


@dataclasses.dataclass(frozen=True)
class StageCost:
    """One stage on one micro-batch (see [Note: the pipeline cost model])."""

    index: int
    blocks: tuple[str, ...]
    parameters: tuple[str, ...]
    parameter_numel: int
    parameter_bytes: int
    flops: float  # forward, the split's count
    forward_s: float
    activation_bytes: int  # saved from F until its B (or W)
    free_activation_bytes: int  # of which computed from the batch alone (held once however many blocks)
    send_bytes: int  # carried out to the next stage (0 on the last)
    send_s: float
    recompute_s: float = 0.0  # forward ops the backward (B) computes again under the activation policy
    recompute_input_s: float = 0.0  # of which I computes (W the rest)

    def action_s(self, op: Op) -> float:
        again = {Op.FORWARD: 0.0, Op.BACKWARD: self.recompute_s, Op.BACKWARD_INPUT: self.recompute_input_s,
                 Op.BACKWARD_WEIGHT: self.recompute_s - self.recompute_input_s}[op]
        return BACKWARD_FACTORS[op] * self.forward_s + again

    def state_bytes(self, optimizer: str) -> int:
        """Parameters, their gradients and the optimizer's state, in the parameters' dtypes."""
        return self.parameter_bytes * (2 + OPTIMIZER_STATES[optimizer])


def parameter_sizes(parameters: dict[str, torch.Tensor], names: Sequence[str]) -> tuple[int, int]:
    """(elements, bytes) of the parameters ``names`` name, a tied weight counted once."""
    held = {id(parameters[n]): parameters[n] for n in names}.values()
    return sum(p.numel() for p in held), sum(p.numel() * p.element_size() for p in held)


def _stage_cost(graphs: StageGraphs, parameters: dict[str, torch.Tensor], spec: DeviceSpec) -> StageCost:
    stage = graphs.stage
    forward_s = sum(node_cost(n, spec).seconds for n in graphs.forward.graph.nodes if n.op == "call_function")

    def recomputed_s(gm: fx.GraphModule) -> float:
        return sum(node_cost(n, spec).seconds for n in gm.graph.nodes if n.op == "call_function" and BLOCK_KEY in n.meta)

    send = sum(math.prod(v.shape) * v.dtype.itemsize for v in stage.carried_out)
    activations, free = saved_activation_bytes(graphs)
    numel, nbytes = parameter_sizes(parameters, stage.parameters)
    return StageCost(
        index=stage.index, blocks=stage.blocks, parameters=stage.parameters, parameter_numel=numel,
        parameter_bytes=nbytes, flops=stage.flops, forward_s=forward_s, activation_bytes=activations,
        free_activation_bytes=free,
        send_bytes=send, send_s=spec.alpha + send * spec.beta if send else 0.0,
        recompute_s=recomputed_s(graphs.backward), recompute_input_s=recomputed_s(graphs.backward_input),
    )


def _shape_key(stage: Stage, last: bool, model_state: dict[str, torch.Tensor]) -> tuple:
    """What a stage's price depends on: its ops and their shapes, its parameters' shapes, what it
    receives and sends; not the names (two middle blocks of a deep model have the same key)."""

    def value(node: fx.Node) -> object:
        if node.op == "get_attr":
            return tuple(getattr(model_state.get(node.target.removeprefix("model.")), "shape", ()))
        val = node.meta.get("val")
        return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else str(val)

    nodes = list(stage.graph.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    ops = tuple((n.op, str(n.target) if n.op == "call_function" else "", value(n),
                 repr(fx.node.map_arg((n.args, n.kwargs), index.__getitem__))) for n in nodes)
    flows = tuple((v.shape, v.dtype, v.requires_grad) for v in (*stage.carried_in, *stage.carried_out))
    return last, stage.batch_inputs, flows, ops


def price_stages(
    model: nn.Module, loss_fn: LossFn, micro_batch: Sequence[torch.Tensor], stages: int, spec: DeviceSpec,
    split_points: Sequence[str] | None = None, *, ranks: int | None = None, schedule: str = "",
    activations: ActivationPolicy = KEEP_ACTIVATIONS, kernels_timed_on: torch.device | None = None,
) -> tuple[StageSplit, tuple[StageCost, ...]]:
    """Capture model + loss at ``micro_batch``, cut ``stages`` stages (``split_stages``), price each."""
    split = split_stages(capture(model, loss_fn, micro_batch), model, stages, split_points, ranks=ranks,
                         schedule=schedule)
    return split, cut_and_price(split, model, micro_batch, spec, activations, kernels_timed_on)


def cut_and_price(
    split: StageSplit, model: nn.Module, micro_batch: Sequence[torch.Tensor], spec: DeviceSpec,
    activations: ActivationPolicy = KEEP_ACTIVATIONS, kernels_timed_on: torch.device | None = None,
) -> tuple[StageCost, ...]:
    return cut_and_price_under(split, model, micro_batch, spec, (activations,), kernels_timed_on)[activations]


def cut_and_price_under(
    split: StageSplit, model: nn.Module, micro_batch: Sequence[torch.Tensor], spec: DeviceSpec,
    policies: Sequence[ActivationPolicy], kernels_timed_on: torch.device | None = None,
) -> dict[ActivationPolicy, tuple[StageCost, ...]]:
    """Each stage priced under each activation policy: a stage whose ops, shapes and blocks' policies another
    has is priced once, and one trace serves every policy (``trace_stage_under``); ``kernels_timed_on``: the
    kernels of the graphs it is priced from timed on that device (``kernel_profile.with_kernel_times``), not
    priced by the roofline."""
    empty = [s.index for s in split.stages if not s.blocks]
    if empty:
        raise OptionsError(f"pipeline inspection: stages {empty} would hold no block; use fewer stages")
    last = len(split.stages) - 1
    parameters = dict(model.named_parameters(remove_duplicate=False))
    state = parameters | dict(model.named_buffers(remove_duplicate=False))
    priced: dict[tuple, StageCost] = {}
    costs: dict[ActivationPolicy, list[StageCost]] = {policy: [] for policy in policies}
    for stage in split.stages:
        shape = _shape_key(stage, stage.index == last, state)
        keys = {p: (shape, tuple(policy_of(p, block) for block in stage.blocks), p.budget_bytes) for p in policies}
        missing = list({keys[p]: p for p in policies if keys[p] not in priced}.values())
        if missing:
            graphs = trace_stage_under(stage, state, stage.index == last, micro_batch, missing)
            for p, g in zip(missing, graphs):
                timed = spec if kernels_timed_on is None else with_kernel_times(
                    spec, [g.forward, g.backward, g.backward_input], kernels_timed_on)
                priced[keys[p]] = _stage_cost(g, parameters, timed)
        for policy in policies:
            costs[policy].append(dataclasses.replace(priced[keys[policy]], index=stage.index, blocks=stage.blocks,
                                                     parameters=stage.parameters, flops=stage.flops))
    return {policy: tuple(c) for policy, c in costs.items()}


def action_cost(costs: Sequence[StageCost], tp: TensorParallelCost | None = None) -> Callable[[Action], float]:
    """Seconds of each compute action of a schedule over these stages, for ``simulate``; under ``tp``, its
    share of the stage's compute plus the tp collectives of that action's graph."""
    # One table lookup an action: a search replays schedules of 10^5 actions, each priced this way.
    if tp is None:
        seconds = {(op, s): c.action_s(op) for s, c in enumerate(costs) for op in COMPUTE_OPS}
    else:
        seconds = {(op, s): c.action_s(op) / tp.degree + tp.seconds[s].get(op, 0.0)
                   for s, c in enumerate(costs) for op in COMPUTE_OPS}
    return lambda a: seconds[a.op, a.stage]


Collectives = dict[Op, tuple[tuple[str, int], ...]]  # per compute op of a stage: (kind, payload bytes) of each


@dataclasses.dataclass(frozen=True)
class TensorParallelCost:
    """The tp collectives each stage's actions run when its layers are split over ``degree`` ranks, and
    their seconds on the tp link (not overlapped with compute). ``read_off_graphs``: counted in the stage
    graphs ``dpar.pipeline``'s tp pass built (``dpar inspect``), or modelled as Megatron (the 3-D planner)."""

    degree: int
    collectives: tuple[Collectives, ...]  # per stage
    seconds: tuple[dict[Op, float], ...]  # per stage and op
    read_off_graphs: bool


def tp_link(spec: DeviceSpec, tp: int) -> tuple[float, float]:
    """The link of a tp group of consecutive ranks: intra-node where ``tp`` fits in a node, else inter-node."""
    return spec.link_among(range(tp))


def tensor_parallel_cost(per_stage: Sequence[Collectives], tp: int, spec: DeviceSpec, read_off_graphs: bool) -> TensorParallelCost:
    link = tp_link(spec, tp)
    seconds = tuple({op: sum(link_time(kind, size, tp, link) for kind, size in found) for op, found in stage.items()}
                    for stage in per_stage)
    return TensorParallelCost(tp, tuple(per_stage), seconds, read_off_graphs)


def megatron_collectives(costs: Sequence[StageCost], block_bytes: int) -> list[Collectives]:
    """The planner's model of a stage's tp collectives: per block, two of its activation's bytes in F and two in
    B (or I), W none (see [Note: choosing the pipeline degree] in planner/pipeline.py)."""
    return [{op: (("all_reduce", block_bytes),) * (2 * len(c.blocks)) for op in
             (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT)} for c in costs]


_TP_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)


@dataclasses.dataclass(frozen=True)
class BlockCollectives:
    """The tp collectives of one block's share of the stage graphs, read off graphs ``dpar.pipeline`` built on a
    copy of the model cut to (at most) three blocks, one a stage: the first block's stage (with what runs before
    the blocks: the embedding), a middle one's, and the last's (with the head and the loss). A stage of
    consecutive blocks runs the concatenation of its blocks' in F and in B (exactly, on HF Llama); how B's divide
    into I and W is the blocks' split summed, an estimate (the tp pass places some differently in a longer
    graph: 7 of a two-block Llama stage's 14 on I by the sum, 5 in its graphs). The planner prices its candidates
    with them."""

    first: Collectives
    middle: Collectives
    last: Collectives

    def of_block(self, index: int, blocks: int) -> Collectives:
        if index == 0:
            return self.first
        return self.last if index == blocks - 1 else self.middle

    def of_stages(self, blocks_per_stage: Sequence[int]) -> list[Collectives]:
        """Each stage's collectives, for stages holding ``blocks_per_stage`` consecutive blocks in order. The first
        stage computes no input gradient (its input is the batch): its backward is all W, I has none."""
        blocks, start, found = sum(blocks_per_stage), 0, []
        for count in blocks_per_stage:
            parts = [self.of_block(i, blocks) for i in range(start, start + count)]
            stage = {op: tuple(c for part in parts for c in part.get(op, ())) for op in _TP_OPS}
            if start == 0:
                stage[Op.BACKWARD_INPUT], stage[Op.BACKWARD_WEIGHT] = (), stage[Op.BACKWARD]
            found.append(stage)
            start += count
        return found


def graph_collectives(graphs: StageGraphs) -> Collectives:
    """The collectives in a stage's F, B, I and W graphs, each at its payload (full-buffer) bytes."""
    graph_of = dict(zip(_TP_OPS, (graphs.forward, graphs.backward, graphs.backward_input, graphs.backward_weight)))
    return {op: tuple((COLLECTIVE_KINDS[n.target], payload_bytes(n)) for n in gm.graph.nodes
                      if n.op == "call_function" and n.target in COLLECTIVE_KINDS)
            for op, gm in graph_of.items()}


def hop_latency(costs: Sequence[StageCost]) -> float:
    """The simulator's one latency per send: the largest stage boundary's."""
    return max((c.send_s for c in costs), default=0.0)
