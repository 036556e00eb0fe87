"""Each rank's own rows through a tensor-parallel group: the joint graph unrolled once per rank of the group.

[Note: the data contract under tensor parallel]
Every strategy keeps DDP's contract: each rank is fed its own slice of the
global batch, and the parameters come out as DDP's, whose gradient is the
average over ranks of each rank's own program (its own loss, reductions over
its own rows, its own BatchNorm statistics). Tensor parallel needs every rank
of a group to run the same rows, so the group's rows are moved, not assumed.

Running the group's slices as one concatenated batch would be cheaper, but any
reduction over rows (a loss averaged over the tokens that are not padding,
BatchNorm) would then mix ranks, and the loss a rank sees would not be its own.
So the joint graph is unrolled: copy ``j`` is rank ``j``'s program, fed rank
``j``'s inputs and, in the backward, rank ``j``'s tangents, each all-gathered
over the group once. Every rank computes its share of every copy (the
tensor-parallel collectives stay matched), returns copy ``rank``'s forward
outputs (its own loss, its own buffer updates), and the parameter gradient is
the mean of the copies' gradients, which is DDP's average over the group. What
depends on parameters alone (fsdp's gathers, casts) is computed once and shared.
The work per rank equals a tensor-parallel step on the group's batch; the
collectives are ``tp`` times as many, each ``1/tp`` the size.

The copies run block by block (``layers.3`` of every copy, then ``layers.4``; in
the backward, from the last block back), not one whole program after another.
A parameter's gradient is then complete once every copy has run its block's
backward, so its data-parallel reduction overlaps the earlier blocks' backward
of every copy; copy after copy, every gradient was complete only in the last
copy's backward, and zero2's reductions of Llama-3-8B cut to 8 layers (tp 8 x
dp 8, h100 preset) were exposed one after another (209 ms a step; 200 ms with
the copies block by block, 184 with their wait no longer pinned by sums of
zeros: compiler/passes/reduce_scatter.py).
An op by op interleave would hold every copy's transients of a block at once.

Random ops (dropout) in a copy draw from this rank's generator, copy after copy,
and each rank draws only for its block of the split heads: the masks are not the
ones rank ``j`` would draw alone, so with dropout on, tensor parallel matches DDP
in distribution, not bit for bit (as Megatron's does).

Which joint-graph values are per-rank is recorded at capture: the backend reads
each user input through ``dpar::own_rows`` (its gradient through
``dpar::own_rows_grad``), identity markers that AOTAutograd traces like any op,
so the pass needs neither placeholder names nor the way AOTAutograd flattens
DTensor inputs. The pass removes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx as fx

from dpar.compiler.graph_utils import fill_fake_values, with_code
from dpar.compiler.lowering import JOINT_INPUTS_KEY
from dpar.compiler.passes.recompute import block_path
from dpar.compiler.propagation.redistribute import ACTIVATION_COLLECTIVE
from dpar.core.torch_internals import C10D_FUNCTIONAL, graph_module

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL



@dataclasses.dataclass(frozen=True)
class GroupBatch:
    """The tensor-parallel group whose ranks' rows are moved: its size, this rank, its name."""

    size: int
    rank: int
    group_name: str


@torch.library.custom_op("dpar::own_rows", mutates_args=())
def own_rows(x: torch.Tensor) -> torch.Tensor:
    """Marks a user input: this rank's rows, which the rest of its tensor-parallel group needs too."""
    return x.clone()


@own_rows.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("dpar::own_rows_grad", mutates_args=())
def own_rows_grad(grad: torch.Tensor) -> torch.Tensor:
    """Marks the gradient of a user input: it is this rank's copy's, not averaged with the group's."""
    return grad.clone()


@own_rows_grad.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


own_rows.register_autograd(lambda ctx, grad: own_rows_grad(grad))

OWN_ROWS = torch.ops.dpar.own_rows.default
OWN_ROWS_GRAD = torch.ops.dpar.own_rows_grad.default


def mark_own_rows(gm: fx.GraphModule, data: Sequence[int]) -> fx.GraphModule:
    """Read each tensor placeholder at a position in ``data`` (the user's inputs) through ``dpar::own_rows``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index in data:
        node = placeholders[index]
        if not isinstance(node.meta.get("example_value", node.meta.get("val")), torch.Tensor):
            continue  # sizes and other non-tensor inputs are the same on every rank of a group
        with gm.graph.inserting_after(node):
            marked = gm.graph.call_function(OWN_ROWS, (node,))
        node.replace_all_uses_with(marked, delete_user_cb=lambda user: user is not marked)
    return with_code(gm)


def _depends_on(graph: fx.Graph, seeds: set[fx.Node]) -> set[fx.Node]:
    found = set(seeds)
    for node in graph.nodes:
        if any(i in found for i in node.all_input_nodes):
            found.add(node)
    return found


def _gathered(graph: fx.Graph, value: fx.Node, group: GroupBatch) -> list[fx.Node]:
    """Every rank's ``value`` (rank j's at position j), from one all-gather.

    This rank's own copy reads its slice of the gathered tensor too, not ``value``: the
    graph is then the same on every rank, and so are the partitioner's choices and the
    order of the collectives it leaves.
    """
    val = value.meta["val"]
    rows = 1 if val.dim() == 0 else val.shape[0]
    dense = graph.call_function(aten.clone.default, (value,), {"memory_format": torch.contiguous_format})
    if val.dim() == 0:
        dense = graph.call_function(aten.unsqueeze.default, (dense, 0))
    gathered = graph.call_function(c10d.all_gather_into_tensor.default, (dense, group.size, group.group_name))
    gathered.meta[ACTIVATION_COLLECTIVE] = True
    waited = graph.call_function(c10d.wait_tensor.default, (gathered,))
    per_rank = []
    for j in range(group.size):
        part = graph.call_function(aten.slice.Tensor, (waited, 0, j * rows, (j + 1) * rows))
        if val.dim() == 0:
            part = graph.call_function(aten.squeeze.dim, (part, 0))
        per_rank.append(part)
    return per_rank


@torch.library.custom_op("dpar::pick_own", mutates_args=())
def pick_own(values: list[torch.Tensor], index: int) -> torch.Tensor:
    """This rank's copy's value. One op that reads every copy, not a reference to one of them,
    so the graph has the same shape on every rank and the partitioner decides alike."""
    return values[index].clone()


@pick_own.register_fake
def _(values: list[torch.Tensor], index: int) -> torch.Tensor:
    return torch.empty_like(values[index])


def _own(graph: fx.Graph, value: object, copies: list[dict[fx.Node, fx.Node]], rank: int) -> object:
    if not isinstance(value, fx.Node):
        return value
    if not isinstance(value.meta.get("val"), torch.Tensor) or len({id(env[value]) for env in copies}) == 1:
        return copies[rank][value]
    return graph.call_function(torch.ops.dpar.pick_own.default, ([env[value] for env in copies], rank))


def _block_runs(nodes: Sequence[fx.Node]) -> list[list[fx.Node]]:
    """``nodes`` (in graph order) cut into runs of one block each, the forward's and the backward's apart.

    A backward node's block is the one of the forward op it differentiates; a node in no block (the
    embedding, the head, the loss, an autograd accumulation) joins the run before it.
    """
    runs: list[list[fx.Node]] = []
    key: tuple[bool, str | None] | None = None
    for node in nodes:
        backward = bool(node.meta.get("autograd_backward"))
        block = block_path(node, "fwd_nn_module_stack" if backward else "nn_module_stack")
        here = (backward, block if block is not None else (key[1] if key is not None and key[0] == backward else None))
        if here != key:
            runs.append([])
            key = here
        runs[-1].append(node)
    return runs


def _mean(graph: fx.Graph, values: list[fx.Node], size: int) -> fx.Node:
    """The copies' gradients averaged in copy order, each added in right after its copy computed it.

    Added at the end instead, every copy's gradient of every parameter lived until then: the group's size
    times the gradients (a 2.8 GiB transient for a 440M Llama under tp 4, beside 2.4 GiB of state).
    """
    total = values[0]
    for value in values[1:]:  # copy j's run follows copy j-1's: ``total`` is already computed here
        with graph.inserting_after(value):
            total = graph.call_function(aten.add.Tensor, (total, value))
    with graph.inserting_after(total):
        return graph.call_function(aten.div.Scalar, (total, size))


def unroll_group_batch(joint: fx.GraphModule, group: GroupBatch) -> fx.GraphModule:
    """The joint graph run once per rank of the group, each copy on that rank's rows; see the Note above.

    Also takes an inference graph (no backward): then every output is a forward output.
    """
    old = joint.graph
    placeholders = [n for n in old.nodes if n.op == "placeholder"]
    outputs = list(old.output_node().args[0])
    num_primals, num_forward = joint.meta.get(JOINT_INPUTS_KEY, (len(placeholders), len(outputs)))
    tangents = [t for t in placeholders[num_primals:] if isinstance(t.meta.get("val"), torch.Tensor)]
    marked = [n for n in old.nodes if n.target is OWN_ROWS]
    varying = _depends_on(old, set(marked) | set(tangents))
    for node in varying:
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            raise NotImplementedError(
                f"tensor parallel with each rank's own rows: the graph mutates {node} ({node.target}) "
                "with per-rank data; feed every rank of the tp group the same rows and pass "
                "parallelize(..., same_batch_in_tp_group=True)"
            )

    graph = fx.Graph()
    shared: dict[fx.Node, fx.Node] = {}
    for node in old.nodes:
        if node.op == "placeholder" or (node.op != "output" and node not in varying):
            shared[node] = graph.node_copy(node, lambda n: shared[n])
    copies: list[dict[fx.Node, fx.Node]] = [dict(shared) for _ in range(group.size)]
    for node in marked:
        for j, value in enumerate(_gathered(graph, shared[node.args[0]], group)):
            copies[j][node] = value
    for node in tangents:
        for j, value in enumerate(_gathered(graph, shared[node], group)):
            copies[j][node] = value
    per_copy = [n for n in old.nodes if n in varying and n.op == "call_function" and n.target is not OWN_ROWS]
    for run in _block_runs(per_copy):
        for env in copies:
            for node in run:
                if node.target is OWN_ROWS_GRAD:
                    env[node] = env[node.args[0]]
                else:
                    env[node] = graph.node_copy(node, lambda n: env[n])

    results = [_own(graph, v, copies, group.rank) for v in outputs[:num_forward]]
    for grad in outputs[num_forward:]:
        if isinstance(grad, fx.Node) and grad in varying and grad.target is not OWN_ROWS_GRAD:
            results.append(_mean(graph, [env[grad] for env in copies], group.size))
        else:  # a user input's gradient is its own copy's, as under DDP
            results.append(_own(graph, grad, copies, group.rank))
    graph.output(tuple(results) if isinstance(old.output_node().args[0], tuple) else results)
    graph.eliminate_dead_code()
    unrolled = graph_module(joint, graph)
    unrolled.meta.update(joint.meta)
    fill_fake_values(unrolled)  # the tensor-parallel pass reads shapes, and refreshes every value after it
    return unrolled
