"""fsdp over the ``dp`` axis of a ``("dp", "pp")`` mesh: shards at rest, gathered once per step.

[Note: sharded data parallel across pipelines]
With ``dp_strategy="fsdp"`` each rank keeps 1/dp of every parameter of its stages at rest (and so
1/dp of their gradients and optimizer state). A pipeline step runs a stage's forward once per
micro-batch; gathering the parameters for each of them would multiply the all-gather by ``m``, so
they are gathered once per step, by the stage's first forward, and dropped when the step ends
(torchtitan keeps FSDP's parameters unsharded across micro-batches under pipelining for the same
reason). Two passes put the collectives in the stage's graphs:

- ``gather_parameters``: in the *gather* variant of the forward (the stage's first ``F``), the
  parameter inputs become one flat shard input, all-gathered over ``dp`` and cut back into whole
  parameters, which the graph also returns for the step's other micro-batches.
- ``reduce_scatter_gradients``: in the *sync* variant of the stage's last ``B`` (or ``W``), the
  accumulated gradients are laid out rank by rank, reduce-scattered, divided by ``dp``, and
  returned as this rank's gradient shards.

A parameter's shard is its rows cut as ``torch.chunk`` cuts them (``ceil(rows / dp)`` rows per
rank, the last ranks fewer or none), flattened and zero-padded to ``ceil(rows / dp)`` rows: the
rows of the ``Shard(0)`` DTensor that ``model.state_dict()`` shows for it (torch's convention, as
under ``dpar.parallelize``'s fsdp), laid out as FSDP's flat parameters are. ``ShardLayout``
records it so that both passes and the runtime agree. ``PipelinePassListing`` in ``pass_listing.py`` runs the
passes, each variant on its own copy of the stage's graph.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from dpar.compiler.graph_utils import refresh_fake_values
from dpar.core.pipeline_program import StageGraphs, SyncVariant
from dpar.core.errors import OptionsError
from dpar.core.torch_internals import C10D_FUNCTIONAL

aten = torch.ops.aten
c10d = C10D_FUNCTIONAL


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """One stage's parameters, each cut into ``dp`` chunks of ``chunks[i]`` elements."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    dp: int

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def chunks(self) -> tuple[int, ...]:
        """Elements of each parameter's shard: ``ceil(rows / dp)`` rows (padded where a rank has fewer)."""
        return tuple(-(-s[0] // self.dp) * math.prod(s[1:]) for s in self.shapes)

    def rows(self, index: int, rank: int) -> tuple[int, int]:
        """(first row, row count) of parameter ``index`` that ``rank`` holds (``torch.chunk``'s cut, ``Shard(0)``'s)."""
        return shard_rows(self.shapes[index][0], self.dp, rank)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(sum(self.chunks[:i]) for i in range(len(self.shapes)))

    @property
    def shard_numel(self) -> int:
        return sum(self.chunks)

    def shard(self, full: torch.Tensor, index: int, rank: int) -> torch.Tensor:
        """This rank's chunk of parameter ``index`` (a copy, zero-padded at the end)."""
        chunk = self.chunks[index]
        flat = torch.zeros(chunk * self.dp, dtype=full.dtype)
        flat[: full.numel()] = full.reshape(-1)
        return flat[rank * chunk:(rank + 1) * chunk].clone()


def shard_rows(rows: int, dp: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of ``rank``'s part of ``rows`` rows cut in ``dp``, as ``torch.chunk`` and ``Shard(0)``."""
    per_rank = -(-rows // dp)
    start = min(rank * per_rank, rows)
    return start, min(per_rank, rows - start)


def layout_of(graphs: StageGraphs, dp: int) -> ShardLayout:
    values = _parameter_placeholders(graphs.forward, graphs)
    scalars = [n for n, v in zip(graphs.parameter_names, values) if v.meta["val"].dim() == 0]
    if scalars:
        raise OptionsError(
            f"pipeline: dp_strategy='fsdp' shards parameters by rows, and {', '.join(scalars)} of stage "
            f"{graphs.stage.index} is a scalar; give it shape (1,), or use dp_strategy='ddp'."
        )
    dtypes = {v.meta["val"].dtype for v in values}
    if len(dtypes) > 1:
        raise OptionsError(
            f"pipeline: dp_strategy='fsdp' shards one flat buffer per stage, and stage {graphs.stage.index} holds "
            f"parameters of several dtypes ({', '.join(sorted(map(str, dtypes)))}); give the model one parameter "
            "dtype, or use dp_strategy='ddp'."
        )
    return ShardLayout(tuple(tuple(v.meta["val"].shape) for v in values), dtypes.pop(), dp)


def _parameter_placeholders(gm: fx.GraphModule, graphs: StageGraphs) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"][: len(graphs.parameter_names)]


def gather_parameters_pass(gm: fx.GraphModule, graphs: StageGraphs, layout: ShardLayout, group_name: str) -> fx.GraphModule:
    """Parameter inputs -> one flat shard input, all-gathered; the whole parameters become extra outputs."""
    graph = gm.graph
    params = _parameter_placeholders(gm, graphs)
    with graph.inserting_before(params[0]):
        shard = graph.placeholder("flat_shard")
    shard.meta["val"] = params[0].meta["val"].new_empty(layout.shard_numel)
    with graph.inserting_before(params[-1].next):
        gathered = graph.call_function(c10d.all_gather_into_tensor.default, (shard, layout.dp, group_name))
        waited = graph.call_function(c10d.wait_tensor.default, (gathered,))
        by_rank = graph.call_function(aten.view.default, (waited, [layout.dp, layout.shard_numel]))
        wholes = []
        for i, param in enumerate(params):
            chunk = graph.call_function(
                aten.slice.Tensor, (by_rank, 1, layout.offsets[i], layout.offsets[i] + layout.chunks[i])
            )
            flat = graph.call_function(aten.reshape.default, (chunk, [-1]))
            flat = graph.call_function(aten.slice.Tensor, (flat, 0, 0, layout.numels[i]))
            whole = graph.call_function(aten.view.default, (flat, list(layout.shapes[i])))
            param.replace_all_uses_with(whole)
            wholes.append(whole)
    for param in params:
        graph.erase_node(param)
    output = graph.output_node()
    output.args = (tuple(output.args[0]) + tuple(wholes),)
    graph.lint()
    gm.recompile()
    return gm


def reduce_scatter_gradients_pass(
    gm: fx.GraphModule, layout: ShardLayout, first: int, group_name: str
) -> fx.GraphModule:
    """Parameter-gradient outputs (from ``first``) -> accumulated, reduce-scattered, averaged shards.

    Takes one extra input per parameter, its gradient accumulated over the step's earlier
    micro-batches. A parameter the stage does not differentiate contributes zeros.
    """
    graph = gm.graph
    output = graph.output_node()
    outputs = list(output.args[0])
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(placeholders[-1].next):
        accumulated = [graph.placeholder(f"accumulated_grad_{i}") for i in range(len(layout.shapes))]
    with graph.inserting_before(output):
        blocks = []
        for i, acc in enumerate(accumulated):
            grad = outputs[first + i]
            total = acc if not isinstance(grad, fx.Node) else graph.call_function(aten.add.Tensor, (grad, acc))
            flat = graph.call_function(aten.reshape.default, (total, [-1]))
            padding = layout.chunks[i] * layout.dp - layout.numels[i]
            if padding:
                flat = graph.call_function(aten.constant_pad_nd.default, (flat, [0, padding]))
            blocks.append(graph.call_function(aten.view.default, (flat, [layout.dp, layout.chunks[i]])))
        by_rank = graph.call_function(aten.cat.default, (blocks, 1))
        by_rank = graph.call_function(aten.div.Tensor, (by_rank, layout.dp))
        flat = graph.call_function(aten.reshape.default, (by_rank, [-1]))
        scattered = graph.call_function(c10d.reduce_scatter_tensor.default, (flat, "sum", layout.dp, group_name))
        shard = graph.call_function(c10d.wait_tensor.default, (scattered,))
        pieces = graph.call_function(aten.split_with_sizes.default, (shard, list(layout.chunks)))
        for i in range(len(layout.shapes)):
            outputs[first + i] = graph.call_function(operator.getitem, (pieces, i))
    output.args = (tuple(outputs),)
    graph.lint()
    gm.recompile()
    return gm


def _refresh(gm: fx.GraphModule) -> fx.GraphModule:
    refresh_fake_values(gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])
    return gm


def gather_parameters(gm: fx.GraphModule, graphs: StageGraphs, layout: ShardLayout, group_name: str) -> fx.GraphModule:
    """The stage's first forward of a step: ``(flat_shard, *buffers, *batch, *carried) -> (..., *parameters)``."""
    return _refresh(gather_parameters_pass(gm, graphs, layout, group_name))


def reduce_scatter_gradients(
    gm: fx.GraphModule, graphs: StageGraphs, which: str, layout: ShardLayout, group_name: str
) -> fx.GraphModule:
    """The stage's last backward of a step (``which``); its parameter gradients are this rank's averaged shards."""
    first = len(graphs.grad_inputs) if which == "backward" else 0
    gm = reduce_scatter_gradients_pass(gm, layout, first, group_name)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, shape in zip(placeholders[len(placeholders) - len(layout.shapes):], layout.shapes):
        node.meta["val"] = placeholders[0].meta["val"].new_empty(shape, dtype=layout.dtype)
    return _refresh(gm)


def scattered_variant(gm: fx.GraphModule, layout: ShardLayout) -> SyncVariant:
    """``reduce_scatter_gradients``' graph: every parameter's accumulated gradient comes in, in order."""
    return SyncVariant(gm, tuple(range(len(layout.shapes))))
