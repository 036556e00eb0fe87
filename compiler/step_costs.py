"""One rank's step priced on the graphs AOTAutograd hands dpar: the one count ``dpar inspect`` and ``dpar plan`` report.

[Note: one count of a step's compute and saved activations]
What a step computes and what its forward saves for its backward are decided by AOTAutograd's
partitioner on the joint graph: the default partitioner (ddp) saves what each op's backward reads;
the min-cut partitioner (zero2, fsdp, any activation policy) recomputes cheap pointwise ops in the
backward and saves less (the test Llama: 15.3 MB under zero2 where ddp saves 18.8 MB). A count per
op (the planner's op graph) cannot follow the min-cut's choices, nor the graph Hugging Face writes
under torch.compile but not under export (its GQA attention copies K and V there). So the figures
both tools report come from ``graph_costs`` over such graphs: ``dpar inspect`` over the graphs it
compiled for N ranks, ``dpar plan`` over the chosen plan's graphs of one rank
(``one_rank_graphs``: the same Dynamo capture, joint passes and partitioner, no collectives),
plus the data-parallel kernels it prices for the plan's mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from dpar.compiler.capture import GraphInput, classify_inputs
from dpar.compiler.costs import DeviceSpec, attention_fused, node_cost
from dpar.compiler.lowering import GraphRole, Lower, compile_graphs
from dpar.compiler.memory import saved_activations
from dpar.compiler.passes.recompute import BLOCK_KEY
from dpar.core.torch_internals import functorch_config, python_meta_kernels_lifted

GraphPair = tuple[fx.GraphModule, fx.GraphModule | None]  # a forward graph and its backward (None: no gradient)


@dataclasses.dataclass(frozen=True)
class RankGraphs:
    """What one Dynamo graph became at one rank: its forward, its backward and the forward's flat inputs."""

    forward: fx.GraphModule
    backward: fx.GraphModule | None
    inputs: tuple[GraphInput, ...]


@dataclasses.dataclass(frozen=True)
class GraphCosts:
    """One rank's step on its graphs: kernel seconds at the roofline and the bytes its forwards save."""

    forward_s: float
    backward_s: float  # the backward's recomputation included
    recompute_s: float  # of which the forward ops an activation policy recomputes (tagged per block)
    saved_bytes: int  # tensors the forwards hand their backwards, gathered parameters aside


def graph_costs(pairs: Sequence[GraphPair], spec: DeviceSpec) -> GraphCosts:
    """See [Note: one count of a step's compute and saved activations]."""
    backward = [n for _, bw in pairs if bw is not None for n in bw.graph.nodes]
    return GraphCosts(
        forward_s=sum(node_cost(n, spec).seconds for fw, _ in pairs for n in fw.graph.nodes),
        backward_s=sum(node_cost(n, spec).seconds for n in backward),
        recompute_s=sum(node_cost(n, spec).seconds for n in backward if n.meta.get(BLOCK_KEY) is not None),
        saved_bytes=saved_activations(pairs),
    )


def is_meta(model: torch.nn.Module, example_inputs: Any = ()) -> bool:
    """Whether any parameter, buffer or input tensor lives on the meta device."""
    tensors = [*model.parameters(), *model.buffers()]
    inputs = example_inputs.values() if isinstance(example_inputs, dict) else (
        example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    )
    tensors += [t for t in inputs if isinstance(t, torch.Tensor)]
    return any(t.is_meta for t in tensors)


def one_rank_graphs(
    model: torch.nn.Module, example_inputs: Sequence[Any], joint_pass: Callable[[fx.GraphModule], fx.GraphModule] | None,
    on_meta: bool,
) -> list[RankGraphs]:
    """``model``'s forward and backward graphs as ``torch.compile`` captures them at one rank, split by
    ``joint_pass`` and the min-cut partitioner (None: AOTAutograd's default partitioner), as dpar's
    backend splits them; ``on_meta``: attention as its fused kernel (see [Note: attention on meta])."""
    found_graphs: list[RankGraphs] = []

    def backend(gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        found: dict[GraphRole, fx.GraphModule] = {}

        def keep(g: fx.GraphModule, ex: Sequence[Any], role: GraphRole, lower: Lower) -> Callable[..., Any]:
            found[role] = g
            return lower(g, ex)

        compiled = compile_graphs(attention_fused(gm) if on_meta else gm, inputs, compiler="aot_eager", hook=keep,
                                  joint_pass=joint_pass)
        forward = found.get(GraphRole.FORWARD, found.get(GraphRole.INFERENCE))
        if forward is not None:
            found_graphs.append(RankGraphs(forward, found.get(GraphRole.BACKWARD), tuple(classify_inputs(gm, inputs))))
        return compiled

    lifted = python_meta_kernels_lifted() if on_meta else contextlib.nullcontext()
    torch.compiler.reset()
    try:  # the backward compiled with its forward (see ``dpar.inspect``'s explain)
        with lifted, functorch_config().patch(force_non_lazy_backward_lowering=True):
            torch.compile(model, backend=backend)(*example_inputs)
    finally:
        torch.compiler.reset()
    return found_graphs
