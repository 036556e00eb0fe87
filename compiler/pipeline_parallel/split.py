"""Cut one captured training graph (model and loss) into pipeline stages.

[Note: what a stage graph holds]
The model and ``loss_fn`` are exported together (``torch.export``, non-strict) at the
micro-batch's shape, so the graph's inputs are the micro-batch's tensors and its one output is
the loss. Nodes are sorted into three kinds:

- *free* values: the batch inputs, buffers and constants, and whatever is computed from them
  alone without randomness (position ids, causal masks, RoPE's cos/sin). Every rank holds the
  whole batch (the executor gathers it) and the buffers, so a stage that reads a free value
  computes it itself: a copy in every stage that needs it, never sent.
- *parameters* (``get_attr`` of an ``nn.Parameter``): read by each stage that uses them; a
  parameter read by two stages (a tied embedding and LM head) is *shared*, and the executor sums
  its gradient over the stages that hold it.
- everything else is *carried*: it belongs to the stage of the block it was traced in (the
  outermost numbered module, ``layers.3``), or, outside every block, to the latest stage among
  its inputs (the embedding to the first stage, the final norm, head and loss to the last).

A carried value produced before stage ``s`` and read at ``s`` or later crosses every boundary on
its way (stage ``s-1`` passes it on), so only neighbouring ranks exchange activations, as the
schedules assume. Stage ``s``'s graph takes ``(batch inputs it reads..., carried in...)`` and
returns the carried values that cross its far boundary, or the loss on the last stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from dpar.compiler.costs import node_flops
from dpar.compiler.passes.random_ops import is_random
from dpar.core.errors import OptionsError, TooFewBlocksError
from dpar.core.pipeline_program import Stage, StageSplit, ValueSpec


class _ModelAndLoss(nn.Module):
    def __init__(self, model: nn.Module, loss_fn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        *model_inputs, target = inputs
        return self.loss_fn(self.model(*model_inputs), target)


def capture(model: nn.Module, loss_fn, micro_batch: Sequence[torch.Tensor]) -> fx.GraphModule:
    """The model and its loss as one ATen graph whose ``get_attr`` nodes are the model's own parameters."""
    exported = torch.export.export(_ModelAndLoss(model, loss_fn), tuple(micro_batch), strict=False)
    gm = exported.module()
    mutated = sorted(_mutated_buffers(gm))
    if mutated:
        raise OptionsError(
            f"pipeline: the forward updates buffers ({', '.join(n.removeprefix('model.') for n in mutated)}), "
            "e.g. BatchNorm's running statistics; a stage cannot yet carry those updates between micro-batches. "
            "Use a normalisation without running statistics (LayerNorm, RMSNorm, GroupNorm), or parallelize(strategy='ddp')."
        )
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and not node.users:  # export's input guard: shapes are fixed here
            gm.graph.erase_node(node)
    writers = _buffer_writing_regions(gm)
    gm.graph.eliminate_dead_code(is_impure_node=lambda node: node in writers or node.is_impure())
    gm.recompile()
    value = _loss_node(gm).meta.get("val")
    if value is None or value.dim() != 0:
        raise OptionsError(
            "pipeline: loss_fn(model(*inputs), target) must return one scalar (the micro-batch's mean loss); "
            f"it returned {None if value is None else tuple(value.shape)}. Reduce it to a scalar in loss_fn."
        )
    return gm


def _mutated_buffers(gm: fx.GraphModule) -> set[str]:
    """Buffers the training graph writes in place (it is not functionalized): schema writes, and the
    running statistics of a training-mode batch norm, whose composite op does not declare them."""
    written = _written_nodes(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) is torch.ops.aten.batch_norm \
                and len(node.args) > 5 and node.args[5]:
            written.update(a for a in node.args[3:5] if isinstance(a, fx.Node))
    return {n.target for n in written if n.op == "get_attr"}


def _buffer_writing_regions(gm: fx.GraphModule) -> set[fx.Node]:
    """The calls of a subgraph (export's ``torch.no_grad()`` region: ``wrap_with_set_grad_enabled``; an autocast
    region's ``wrap_with_autocast``) that write a buffer passed to them in place. Their results are read by no
    one: kept for the write, which a stage's F then runs ([Note: a buffer a stage's forward accumulates into] in
    stage_graphs.py, which checks the kind)."""
    buffer_targets = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    buffers = {n for n in gm.graph.nodes if n.op == "get_attr" and n.target in buffer_targets}
    writers = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        body = next((a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"
                     and isinstance(getattr(gm, a.target, None), fx.GraphModule)), None)
        if body is None:
            continue
        operands = node.args[node.args.index(body) + 1:]
        inner = [n for n in getattr(gm, body.target).graph.nodes if n.op == "placeholder"]
        written = {operands[inner.index(n)] for n in _written_nodes(getattr(gm, body.target)) if n in inner}
        if written & buffers:
            writers.add(node)
    return writers


def written_in_place(node: fx.Node) -> list[fx.Node]:
    """The arguments ``node``'s op writes in place (its schema says so)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    return [value for argument, value in zip(schema.arguments, node.args)
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, fx.Node)]


def _written_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes ``gm``'s ops write in place."""
    return {value for node in gm.graph.nodes for value in written_in_place(node)}


def _loss_node(gm: fx.GraphModule) -> fx.Node:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = output.args[0]
    return value[0] if isinstance(value, (tuple, list)) else value


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _block_of(path: str, prefix: str) -> int | None:
    if not path.startswith(prefix + "."):
        return None
    head = path[len(prefix) + 1:].split(".")[0]
    return int(head) if head.isdigit() else None


def find_blocks(gm: fx.GraphModule) -> tuple[str, list[int]]:
    """The numbered module list with the most members that carry computation (``model.layers``)."""
    members: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        parts = _module_path(node).split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                members.setdefault(".".join(parts[:i]), set()).add(int(part))
                break
    if not members:
        raise OptionsError(
            "pipeline: the model has no numbered blocks (an nn.ModuleList or nn.Sequential of layers) to cut "
            "between stages. Put the repeated layers in an nn.ModuleList, or pass split_points=[module names]."
        )
    prefix = max(members, key=lambda p: (len(members[p]), -len(p)))
    return prefix, sorted(members[prefix])


def _parameter_targets(gm: fx.GraphModule) -> set[str]:
    return {name for name, _ in gm.named_parameters(remove_duplicate=False)}


def _classify(gm: fx.GraphModule) -> tuple[set[fx.Node], set[fx.Node]]:
    """(free nodes, parameter nodes), as in [Note: what a stage graph holds]."""
    parameter_targets = _parameter_targets(gm)
    free: set[fx.Node] = set()
    params: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            free.add(node)
        elif node.op == "get_attr":
            (params if node.target in parameter_targets else free).add(node)
        elif node.op == "call_function" and not is_random(node):
            if all(arg in free for arg in node.all_input_nodes):
                free.add(node)
    return free, params


def _flops(node: fx.Node) -> float:
    """A node's weight in the stage balance: its forward FLOPs (``costs.node_flops``, the one count), or
    its output's size for memory-bound ops, so that blocks of elementwise ops still weigh something."""
    out = node.meta.get("val")
    if node.op != "call_function" or not isinstance(out, torch.Tensor):
        return 0.0
    return float(node_flops(node) or out.numel())


def balanced_cuts(costs: Sequence[float], stages: int) -> list[int]:
    """First block of each stage, minimising the largest stage's cost (contiguous blocks, exact DP)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for end in range(s, n + 1):
            for start in range(s - 1, end):
                worst = max(best[s - 1][start], prefix[end] - prefix[start])
                if worst < best[s][end] - 1e-9 * worst:
                    best[s][end], cut[s][end] = worst, start
    starts, end = [], n
    for s in range(stages, 0, -1):
        starts.append(cut[s][end])
        end = cut[s][end]
    return starts[::-1]


def _user_cuts(split_points: Sequence[str], prefix: str, blocks: list[int], stages: int) -> list[int]:
    names = [f"{prefix}.{b}" for b in blocks]
    starts = [0]
    for point in split_points:
        matches = [i for i, name in enumerate(names) if name == point or name.endswith("." + point) or name == "model." + point]
        if not matches:
            raise OptionsError(
                f"pipeline: split point {point!r} is not one of the blocks the model runs "
                f"({names[0]} .. {names[-1]}); name the first block of each stage after the first."
            )
        starts.append(matches[0])
    if len(starts) != stages:
        raise OptionsError(
            f"pipeline: {len(split_points)} split points make {len(starts)} stages, but stages={stages}; "
            f"give stages - 1 = {stages - 1} split points."
        )
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise OptionsError(
            f"pipeline: split points {list(split_points)} leave a stage without blocks (each must come after the "
            "previous one, in the model's order); list them in order, one per stage boundary."
        )
    return starts


def _too_few_blocks(prefix: str, blocks: int, stages: int, ranks: int, schedule: str) -> TooFewBlocksError:
    """The error for ``stages > blocks``; with several stages on each rank (zbv's V, interleaved) the fixes differ."""
    head = f"pipeline: stages={stages} but the model has only {blocks} blocks in {prefix!r} to cut between"
    per_rank = stages // ranks
    if per_rank == 1:
        return TooFewBlocksError(f"{head}; use at most {blocks} stages (or a deeper model).")
    fixes = [f"schedule='zb_h1' or '1f1b' with stages={ranks} (one per rank)"] if ranks <= blocks else []
    if blocks >= per_rank:
        fixes.append(f"{schedule!r} on at most {blocks // per_rank} ranks")
    return TooFewBlocksError(
        f"{head}: schedule={schedule!r} runs {per_rank} stages on each of the {ranks} ranks; use at most {blocks} "
        f"stages: {', '.join([*fixes, 'or a deeper model'])}."
    )


def split_stages(
    gm: fx.GraphModule, model: nn.Module, stages: int, split_points: Sequence[str] | None = None, *,
    ranks: int | None = None, schedule: str = "",
) -> StageSplit:
    """Cut ``gm`` (from ``capture``) into ``stages`` stage graphs at block boundaries, for ``schedule`` on
    ``ranks`` ranks (default: one stage on each rank), which only shapes the error when the blocks are too few."""
    prefix, blocks = find_blocks(gm)
    if stages > len(blocks):
        raise _too_few_blocks(prefix, len(blocks), stages, ranks or stages, schedule)
    free, params = _classify(gm)
    nodes = list(gm.graph.nodes)
    block_cost = [0.0] * len(blocks)
    position = {b: i for i, b in enumerate(blocks)}
    pre = post = 0.0
    seen_block = False
    for node in nodes:
        if node in free or node in params or node.op != "call_function":
            continue
        b = _block_of(_module_path(node), prefix)
        if b is not None and b in position:
            block_cost[position[b]] += _flops(node)
            seen_block = True
        elif seen_block:
            post += _flops(node)
        else:
            pre += _flops(node)
    if split_points is not None:
        starts = _user_cuts(split_points, prefix, blocks, stages)
    else:
        # The stem's cost weighs on the first stage and the head's on the last: fold them into
        # the first and last block for balancing.
        costs = list(block_cost)
        costs[0] += pre
        costs[-1] += post
        starts = balanced_cuts(costs, stages)
    stage_of_block = {}
    for s, start in enumerate(starts):
        end = starts[s + 1] if s + 1 < stages else len(blocks)
        for i in range(start, end):
            stage_of_block[blocks[i]] = s

    stage_of: dict[fx.Node, int] = {}
    for node in nodes:
        if node in free or node in params or node.op in ("output", "placeholder"):
            continue
        inputs = [stage_of[a] for a in node.all_input_nodes if a in stage_of]
        earliest = max(inputs, default=0)
        b = _block_of(_module_path(node), prefix)
        stage = stage_of_block.get(b, earliest) if b is not None else earliest
        if stage < earliest:
            raise OptionsError(
                f"pipeline: {node.name} in block {prefix}.{b} reads a value computed in a later block; "
                "the blocks must run in their numbered order to be cut into stages. Pass split_points explicitly."
            )
        stage_of[node] = stage
    last = stages - 1
    if stage_of.get(_loss_node(gm), last) != last:  # the loss is on the last stage even if the head is cheap
        raise OptionsError("pipeline: the loss is computed before the last block; the last stage would be idle.")

    readers: dict[fx.Node, set[int]] = {}
    for node in nodes:
        if node in stage_of:
            for arg in node.all_input_nodes:
                readers.setdefault(arg, set()).add(stage_of[node])
    result = tuple(
        _stage_graph(gm, s, stages, stage_of, free, params, readers, starts, blocks, prefix) for s in range(stages)
    )
    # Tied weights may reach the graph under two names: sharing is by the parameter itself.
    by_name = dict(model.named_parameters(remove_duplicate=False))
    holders: dict[int, set[int]] = {}
    for stage in result:
        for name in stage.parameters:
            holders.setdefault(id(by_name[name]), set()).add(stage.index)
    shared = sorted(name for name, p in model.named_parameters() if len(holders.get(id(p), ())) > 1)
    return StageSplit(result, prefix, tuple(shared))


def _spec(node: fx.Node) -> ValueSpec:
    value = node.meta["val"]
    return ValueSpec(node.name, tuple(value.shape), value.dtype, value.is_floating_point())


def _stage_graph(
    gm: fx.GraphModule, s: int, stages: int, stage_of: dict[fx.Node, int], free: set[fx.Node],
    params: set[fx.Node], readers: dict[fx.Node, set[int]], starts: list[int], blocks: list[int], prefix: str,
) -> Stage:
    nodes = list(gm.graph.nodes)
    carried_in = [n for n in nodes if stage_of.get(n, s) < s and any(r >= s for r in readers.get(n, ()))]
    carried_out = [n for n in nodes if stage_of.get(n, s + 1) <= s and any(r > s for r in readers.get(n, ()))]
    own = [n for n in nodes if stage_of.get(n) == s]
    needed: set[fx.Node] = set()
    stack = [a for n in own for a in n.all_input_nodes if a in free or a in params]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(a for a in n.all_input_nodes if a in free or a in params)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    batch_inputs = tuple(i for i, p in enumerate(placeholders) if p in needed)
    for i in batch_inputs:
        env[placeholders[i]] = graph.placeholder(placeholders[i].name)
        env[placeholders[i]].meta = dict(placeholders[i].meta)
    for n in carried_in:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in nodes:
        if n in env or n.op in ("placeholder", "output"):
            continue
        if n in needed or stage_of.get(n) == s:
            env[n] = graph.node_copy(n, lambda a: env[a])
    if s == stages - 1:
        graph.output(env[_loss_node(gm)])
    else:
        graph.output(tuple(env[n] for n in carried_out))
    stage_gm = fx.GraphModule(gm, graph)
    stage_gm.graph.lint()
    end = starts[s + 1] if s + 1 < stages else len(blocks)
    return Stage(
        index=s,
        graph=stage_gm,
        batch_inputs=batch_inputs,
        carried_in=tuple(_spec(n) for n in carried_in),
        carried_out=tuple(_spec(n) for n in carried_out) if s < stages - 1 else (),
        parameters=tuple(sorted({n.target.removeprefix("model.") for n in needed if n in params})),
        blocks=tuple(f"{prefix.removeprefix('model.')}.{blocks[i]}" for i in range(starts[s], end)),
        flops=sum(_flops(n) for n in own),
    )
