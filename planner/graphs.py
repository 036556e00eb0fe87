"""The chosen plan's compute and saved activations counted on its graphs, as ``dpar inspect`` counts them.

[Note: the planner searches on its op graph and reports on the graphs]
The search prices every layout and candidate per op (``costs.py``): fast, and good enough to rank
plans. With ``dpar.plan(..., on_graphs=True)`` (what ``dpar plan`` prints unless ``--op-graph``), the
plan it chooses is then priced again on the graphs dpar compiles for it: one rank's forward and
backward as ``torch.compile`` captures them, split by the joint passes and partitioner the plan's
strategy uses (``compiler/step_costs.py``), plus the data-parallel kernels of the plan's mesh, which a
graph of one rank does not run (``CostModel.dp_kernel_bytes``, and ddp's copies into its buckets as its
bucket schedule lays them out on that backward: ``compiler.data_parallel.bucket_copy_bytes``). Compute,
recompute and saved activations are then the figures ``dpar inspect`` reports (Llama-3-8B, fsdp on 64
H100s: 21.00 GB saved, where the op graph counts 25.32 GB: the min-cut partitioner recomputes pointwise
ops the op graph counts as saved); memory is the search's state and gathered parameters plus those
activations, and the step the search's communication over that compute. Plans with a tensor-parallel
axis keep the op graph's figures (``Plan.priced_on``): one rank's graphs are not what a tensor-parallel
rank runs. The compile costs what ``dpar inspect``'s does less dpar's passes (Llama-3-8B: about 30 s of
CPU), which is why the search does not run it and ``on_graphs`` is off in ``dpar.plan`` (``strategy="auto"``
plans without it).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from dpar.compiler.costs import DeviceSpec
from dpar.compiler.data_parallel import bucket_copy_bytes
from dpar.compiler.passes.random_ops import save_random_ops
from dpar.compiler.passes.recompute import tag_recompute
from dpar.compiler.step_costs import graph_costs, one_rank_graphs
from dpar.core.plan import ActivationPolicy
from dpar.core.torch_internals import pytree
from dpar.planner.costs import CostModel
from dpar.planner.evaluate import Assignment, chosen
from dpar.planner.layout import Layout
from dpar.planner.opgraph import OpGraph
from dpar.planner.plan import Plan

ON_GRAPHS = "compiled graphs"


def joint_pass(data_parallel: str, activations: ActivationPolicy) -> Callable[[fx.GraphModule], fx.GraphModule] | None:
    """What dpar's backend runs on a data-parallel joint graph of one rank (``PassListing.joint_passes`` less the
    passes on collectives): zero2 and fsdp save random ops for the min-cut partitioner, a policy tags its blocks;
    ddp keeping every activation runs none (AOTAutograd's default partitioner)."""
    passes = [save_random_ops] if data_parallel != "replicate" else []
    if activations.recomputes:
        passes.append(lambda g: tag_recompute(g, activations))
    if not passes:
        return None

    def run(joint: fx.GraphModule) -> fx.GraphModule:
        for p in passes:
            joint = p(joint)
        return joint

    return run


def rank_slice(example_inputs: Sequence[object], batch_size: int, rows: int) -> tuple[object, ...]:
    """One rank's rows of the global batch: the first ``rows`` of every tensor whose dim 0 is the batch."""
    def first_rows(x: object) -> object:
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch_size:
            return x[:rows]
        return x

    return tuple(pytree.tree_map(first_rows, tuple(example_inputs)))


def on_meta(model: nn.Module, example_inputs: tuple[object, ...]) -> tuple[nn.Module, tuple[object, ...]]:
    """A copy of ``model`` whose parameters and buffers are meta tensors shaped as its own (no data copied, ties
    kept), and the inputs on meta: compiling runs the forward, which on shapes alone (the planner's contract: the
    global batch may be uninitialised) must compute nothing, and must not touch the user's model."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    moved = pytree.tree_map(lambda x: x.detach().to("meta").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x,
                            example_inputs)
    return copy.deepcopy(model, memo), tuple(moved)


def priced_on_graphs(plan: Plan, graph: OpGraph, model: nn.Module, example_inputs: Sequence[object], device: DeviceSpec) -> Plan:
    """``plan`` with its compute, recompute, saved activations, memory and step counted on its graphs (see the Note)."""
    layout = Layout(plan.mesh_shape, plan.mesh_dim_names, plan.data_parallel)
    if layout.tp_degree > 1:
        return plan
    work, inputs = on_meta(model, rank_slice(example_inputs, graph.batch_size, graph.batch_size // layout.dp_degree))
    found = one_rank_graphs(work, inputs, joint_pass(plan.data_parallel, plan.activations), on_meta=True)
    costs = graph_costs([(g.forward, g.backward) for g in found], device)
    model_costs = CostModel(graph, layout, device)
    assignment = Assignment(layout, (0,) * len(graph.ops))  # no tp axis: one candidate per op
    picked = chosen(graph, assignment)
    kernels = {"forward": 0.0, "backward": 0.0}
    dp = model_costs.dp_latency()
    held = 0.0  # parameter state and gathered parameters, without the op graph's activations
    for o, cand in enumerate(picked):
        for phase, nbytes in model_costs.dp_kernel_bytes(model_costs.owned_bytes(o, cand)).items():
            kernels[phase] += nbytes / device.memory_bandwidth
        cost = model_costs.op_cost(o, cand)
        dp["forward"] += cost.dp_fwd
        dp["backward"] += cost.dp_bwd
        held += cost.memory - graph.ops[o].count * model_costs.saved_bytes(o, cand) if graph.ops[o].kind != "output" else 0.0
    if layout.data_parallel == "replicate" and layout.dp_degree > 1:  # ddp's copies into its buckets, as it plans them
        copied = sum(bucket_copy_bytes(g.backward, g.inputs, layout.dp_degree, device) for g in found if g.backward is not None)
        kernels["backward"] += copied / device.memory_bandwidth
    forward = costs.forward_s + kernels["forward"]
    backward = costs.backward_s - costs.recompute_s + kernels["backward"]
    c = plan.cost
    exposed = c.tp_comm_s + max(0.0, dp["forward"] - forward) + max(0.0, dp["backward"] - backward - costs.recompute_s)
    cost = dataclasses.replace(
        c, compute_s=forward + backward, recompute_s=costs.recompute_s, exposed_comm_s=exposed,
        step_s=forward + backward + costs.recompute_s + exposed, memory_bytes_per_rank=round(held) + costs.saved_bytes,
        activation_bytes_per_rank=costs.saved_bytes,
    )
    return dataclasses.replace(plan, cost=cost, priced_on=ON_GRAPHS)
