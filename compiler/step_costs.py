"""A step's compute, recomputation and saved activations counted on the graphs AOTAutograd hands dpar.

[Note: one count of a step's compute and saved activations]
What a step computes and what its forward saves for its backward are decided by AOTAutograd's
partitioner on the joint graph: the default partitioner (ddp) saves what each op's backward reads;
the min-cut partitioner (zero2, fsdp, any activation policy) recomputes cheap pointwise ops in the
backward and saves less (the test Llama: 15.3 MB under zero2 where ddp saves 18.8 MB). A count per
op (the planner's op graph) cannot follow the min-cut's choices, nor the graph Hugging Face writes
under torch.compile but not under export (its GQA attention copies K and V there). So the figures
``dpar inspect`` reports come from ``graph_costs`` over the graphs it compiled for N ranks, and
``dpar plan`` reports inspect's figures for the plan it chooses (api/planning.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from dpar.compiler.costs import DeviceSpec, node_cost
from dpar.compiler.memory import saved_activations
from dpar.compiler.passes.recompute import BLOCK_KEY

GraphPair = tuple[fx.GraphModule, fx.GraphModule | None]  # a forward graph and its backward (None: no gradient)


@dataclasses.dataclass(frozen=True)
class GraphCosts:
    """What a step's backward recomputes and what its forwards save, on its graphs."""

    recompute_s: float  # the forward ops an activation policy recomputes in the backward (tagged per block)
    saved_bytes: int  # tensors the forwards hand their backwards, gathered parameters aside


def graph_costs(pairs: Sequence[GraphPair], spec: DeviceSpec) -> GraphCosts:
    """See [Note: one count of a step's compute and saved activations]."""
    return GraphCosts(
        recompute_s=sum(node_cost(n, spec).seconds for _, bw in pairs if bw is not None for n in bw.graph.nodes
                        if n.meta.get(BLOCK_KEY) is not None),
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
