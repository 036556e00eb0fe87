"""Activation checkpointing from the plan: recompute tags on the joint graph, per block.

[Note: activation checkpointing as a plan decision]
``ParallelPlan.activations`` says, per block (a numbered layer such as ``layers.3``), what
the forward keeps for the backward. It is applied here, on AOTAutograd's joint graph before
the min-cut partitioner splits it, as the tags the partitioner honours
(``node.meta["recompute"]``, a ``torch.utils.checkpoint.CheckpointPolicy``, and
``node.meta["ac_graph_id"]``, one per block instance), rather than by wrapping modules in
``torch.utils.checkpoint``: the model stays the user's, the decision can be made after
capture (by the planner, from costs), and it composes with the tags the strategies already
put there (fsdp's re-gathers, sequence parallel's gathers). The partitioner recomputes every
``PREFER_RECOMPUTE`` node the backward needs (an infinite edge to its sink), never
recomputes a ``MUST_SAVE`` one, and where a tagged node feeds a tagged node of a later
``ac_graph_id`` it saves the first: so under ``full`` each block's input (the previous
block's output) is saved and the rest of the block is computed again in the backward.
``selective`` saves the outputs of matmuls (mm, addmm, bmm, baddbmm, convolution) and of
attention, and recomputes the cheap ops between them (norms, activations, rotary, residuals),
as torchtitan's op-level policy does. A block is found from what Dynamo recorded at capture
(``nn_module_stack``: the module that ran the op), never from node names.

Communication is never recomputed by this pass. Every ``_c10d_functional`` node (parameter
gathers, tensor parallel's activation all-reduces, their waits) keeps the tag its strategy
gave it, or gets ``MUST_SAVE``: zero2's gathered parameters stay saved for the backward and
the recomputation reads them; fsdp's gathers were already must-recompute (reshard after
forward), so the backward's one re-gather serves both the recomputed matmul and the gradient,
one gather per parameter in each graph exactly as without checkpointing. A recomputed region
only ever reads a collective's saved output.

Random ops (dropout, ``rand*``, ``bernoulli``; CPU attention is tagged random too) are not
recomputed: replaying them needs the RNG state saved and restored around the recomputation
(``run_and_save_rng_state``), which on CPU is not guaranteed to draw the same bits under
every strategy and which breaks AOTAutograd's saved-value order under the sharded ones (see
[Note: checkpointed random ops and saved DeviceMeshes]). Their outputs are saved
(``MUST_SAVE``; a tuple-valued op through its ``getitem``s): the backward reads the mask the
forward drew, so the numbers are those of training without checkpointing, bit for bit, at
the cost of keeping that output.

A budget (``ActivationPolicy.budget_bytes``, saved bytes per rank) is met with the same three
policies: the pass walks a ladder from keep everywhere to full everywhere, one block at a time
(the first n blocks selective, then the first n full), partitions a copy of the joint graph at
each step it tries (a binary search: the saved bytes fall along the ladder) and keeps the first
policy whose forward saves at most the budget; none fits: a named error with the smallest figure.

Buffers mutated in the forward (BatchNorm's running statistics) are updated once: the joint
graph is functional, the new statistics are forward outputs that the forward graph copies
into the buffers, and a recomputed BatchNorm in the backward only feeds the gradient (its
statistics outputs are dead there). Nodes outside any block (embeddings, the head, the loss)
are left to the partitioner, as without a policy.
"""

from __future__ import annotations

import logging
import operator
import re

import torch
import torch.fx as fx
from functorch.compile import min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

from dpar.compiler.collectives import is_communication
from dpar.compiler.graph_utils import copy_graph_module
from dpar.compiler.lowering import JOINT_INPUTS_KEY, PARTITION_KWARGS_KEY
from dpar.compiler.passes.random_ops import is_random, with_outputs
from dpar.core.errors import ActivationPolicyError
from dpar.core.plan import ActivationPolicy, Recompute
from dpar.surgery.sharding import block_of

log = logging.getLogger(__name__)

aten = torch.ops.aten

# Outputs selective checkpointing saves: the matmuls and attention (their cost is the step's).
SAVED_BY_SELECTIVE = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
    aten.convolution.default, aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten.scaled_dot_product_attention.default,
})

RECOMPUTE_KEY, GRAPH_ID_KEY = "recompute", "ac_graph_id"
BLOCK_KEY = "dpar_block"
"""``node.meta`` key this pass sets on each forward node of a block: the block's path (``layers.3``)."""

# The compiled frame's local holding the root module: ``L['self']`` (its forward), ``L['args'][0]`` (a wrapper taking
# ``*args``: Hugging Face's decorated forwards), ``L['model']`` (a function given the model), ``L__self__`` (older).
_ROOT = re.compile(r"^L\['[^']*'\](?:\[\d+\])*\.?|^L__self__\.?")
_INDEX = re.compile(r"\[(\d+)\]")


def module_path(node: fx.Node, stack_key: str = "nn_module_stack") -> str | None:
    """The dotted path (from the compiled module) of the innermost module that ran ``node``, as
    Dynamo recorded it in ``nn_module_stack``; None outside every module. A joint graph's backward
    node has no stack of its own: ``stack_key="fwd_nn_module_stack"`` reads the one AOTAutograd
    copies onto it from the forward op it differentiates."""
    stack = node.meta.get(stack_key)
    if not stack:
        return None
    path, _ = list(stack.values())[-1]
    path = _INDEX.sub(r".\1", _ROOT.sub("", str(path)))
    return path.replace("._modules['", ".").replace("']", "")


def block_path(node: fx.Node, stack_key: str = "nn_module_stack") -> str | None:
    """The block (outermost numbered module, ``layers.3``) ``node`` ran in, or None."""
    path = module_path(node, stack_key)
    block = block_of(path + ".") if path else "root"
    return None if block == "root" else block


def policy_of(policy: ActivationPolicy, block: str) -> Recompute:
    """The block's policy: named exactly, or by a suffix (a block named from an inner module of the
    one compiled: ``model.layers.0`` for ``inner.model.layers.0``)."""
    for name, recompute in policy.blocks:
        if block == name or block.endswith("." + name):
            return recompute
    return policy.default


def forward_nodes(joint: fx.GraphModule) -> set[fx.Node]:
    """The nodes the forward outputs are computed from (the partitioner's required forward)."""
    outputs = joint.graph.output_node().args[0]
    count = joint.meta.get(JOINT_INPUTS_KEY, (0, len(outputs)))[1]
    seen: set[fx.Node] = set()
    stack = [o for o in outputs[:count] if isinstance(o, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


CHOSEN_KEY = "dpar_activation_policy"
"""``gm.meta`` key on the joint graph: the per-block policy applied (a budget's choice included)."""


def tag_recompute(joint: fx.GraphModule, policy: ActivationPolicy) -> fx.GraphModule:
    """Tag each block's forward nodes for the partitioner by ``policy`` (see the Note above); a budget
    is first turned into the per-block policy that meets it (``fit_budget``)."""
    if policy.budget_bytes is not None:
        policy = fit_budget(joint, policy.budget_bytes)
    joint.meta[CHOSEN_KEY] = policy
    return _tagged(joint, policy)


def saved_bytes(forward: fx.GraphModule) -> int:
    """Bytes of the tensors the forward computes and returns: what it saves for the backward (and its
    loss); its inputs returned again (parameters) are not counted."""
    saved = {
        o for o in forward.graph.output_node().args[0]
        if isinstance(o, fx.Node) and o.op != "placeholder" and isinstance(o.meta.get("val"), torch.Tensor)
    }
    return sum(o.meta["val"].numel() * o.meta["val"].element_size() for o in saved)


def blocks_in(joint: fx.GraphModule) -> list[str]:
    """The blocks the joint graph's forward runs, in order."""
    forward = forward_nodes(joint)
    found = (block_path(n) for n in joint.graph.nodes if n.op == "call_function" and n in forward)
    return [b for b in dict.fromkeys(found) if b is not None]


def ladder(blocks: list[str]) -> list[ActivationPolicy]:
    """keep everywhere, then the first 1, 2, ... blocks selective, then the first 1, 2, ... full."""
    rungs, current = [ActivationPolicy()], {b: Recompute.KEEP for b in blocks}
    for recompute in (Recompute.SELECTIVE, Recompute.FULL):
        for block in blocks:
            current[block] = recompute
            rungs.append(ActivationPolicy(blocks=tuple(current.items())))
    return rungs


def saved_under(joint: fx.GraphModule, policy: ActivationPolicy) -> int:
    """The bytes the forward would save under ``policy``: a copy of ``joint`` tagged and partitioned."""
    trial = copy_graph_module(joint)
    trial.meta.update(joint.meta)
    kwargs = joint.meta.get(PARTITION_KWARGS_KEY, {"num_fwd_outputs": joint.meta[JOINT_INPUTS_KEY][1]})
    forward, _ = min_cut_rematerialization_partition(_tagged(trial, policy), None, **kwargs)
    return saved_bytes(forward)


def fit_budget(joint: fx.GraphModule, budget_bytes: int) -> ActivationPolicy:
    """The first rung of ``ladder`` whose forward saves at most ``budget_bytes`` (binary search)."""
    rungs = ladder(blocks_in(joint))
    smallest = saved_under(joint, rungs[-1])
    if smallest > budget_bytes:
        raise ActivationPolicyError(
            f"activation budget of {budget_bytes:,} bytes per rank: even full recomputation of every block saves "
            f"{smallest:,} bytes (block inputs, attention and random-op outputs, what runs outside blocks); "
            f"raise the budget to at least {smallest:,}, or shard more")
    low, high = 0, len(rungs) - 1  # rungs[high] fits
    while low < high:
        middle = (low + high) // 2
        if saved_under(joint, rungs[middle]) <= budget_bytes:
            high = middle
        else:
            low = middle + 1
    log.info("activation budget %d bytes: %s", budget_bytes, rungs[high])
    return rungs[high]


def _tagged(joint: fx.GraphModule, policy: ActivationPolicy, forward: set[fx.Node] | None = None) -> fx.GraphModule:
    """Tags already set by the strategy's passes (gathers, sequence parallel) are kept; a node of a
    ``keep`` block is left untagged. ``forward``: the joint graph's forward nodes where its outputs
    do not say (a pipeline stage's, cut by data dependence)."""
    forward = forward_nodes(joint) if forward is None else forward
    keep_collectives_in_forward(joint, forward)
    instance: dict[str, int] = {}
    for node in joint.graph.nodes:
        if node.op != "call_function" or node not in forward:
            continue
        block = block_path(node)
        if block is None:
            continue
        recompute = policy_of(policy, block)
        if recompute is Recompute.KEEP:
            continue
        node.meta[BLOCK_KEY] = block
        node.meta[GRAPH_ID_KEY] = instance.setdefault(block, len(instance))
        if RECOMPUTE_KEY in node.meta:  # the strategy's decision (fsdp's re-gather, a saved gather)
            continue
        if is_communication(node) or is_random(node):
            for saved in with_outputs(node):
                saved.meta[RECOMPUTE_KEY] = CheckpointPolicy.MUST_SAVE
        elif recompute is Recompute.SELECTIVE and node.target in SAVED_BY_SELECTIVE:
            for saved in with_outputs(node):
                saved.meta[RECOMPUTE_KEY] = CheckpointPolicy.MUST_SAVE
        elif node.target is operator.getitem and RECOMPUTE_KEY in node.args[0].meta:
            node.meta[RECOMPUTE_KEY] = node.args[0].meta[RECOMPUTE_KEY]
        else:
            node.meta[RECOMPUTE_KEY] = CheckpointPolicy.PREFER_RECOMPUTE
    return joint


def tag_stage_recompute(joint: fx.GraphModule, policy: ActivationPolicy, forward: set[fx.Node]) -> fx.GraphModule:
    """``tag_recompute`` for a pipeline stage's joint graph, whose ``forward`` nodes its cut found: a
    per-block policy (the cut meets a budget itself, per stage: ``stage_graphs._fit_budget``)."""
    joint.meta[CHOSEN_KEY] = policy
    return _tagged(joint, policy, forward)


def recomputed_in_backward(node: fx.Node) -> bool:
    """Whether a stage's backward computes ``node`` again rather than the forward saving it: a node of a
    recomputing block tagged prefer-recompute, never a collective."""
    return (BLOCK_KEY in node.meta and node.meta.get(RECOMPUTE_KEY) is CheckpointPolicy.PREFER_RECOMPUTE
            and not is_communication(node))


def keep_collectives_in_forward(joint: fx.GraphModule, forward: set[fx.Node] | None = None) -> fx.GraphModule:
    """Every forward collective the plan does not gather again (all but fsdp's must-recompute gathers)
    is must-save and tagged to stay in the forward graph.

    Must-save keeps the min-cut from recomputing it. The tag is for the backward's extraction, which
    copies every node whose inputs it has and drops only dead pure ones: a collective is not pure, so
    one whose input the backward can compute (tensor parallel's all-reduce after a recomputed matmul)
    would run again there, dead, with the matmul feeding it. Tensor parallel's joint graphs run it without a
    policy too (``PassListing.joint_passes``): the min-cut partitioner recomputes cheap ops on its own."""
    forward = forward_nodes(joint) if forward is None else forward
    for node in joint.graph.nodes:
        if node.op != "call_function" or node not in forward or not is_communication(node):
            continue
        if node.meta.get(RECOMPUTE_KEY) in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
            continue
        node.meta[RECOMPUTE_KEY] = CheckpointPolicy.MUST_SAVE
        node.meta["partitioner_tag"] = "must_be_in_forward"
    return joint


def recomputed_per_block(forward: fx.GraphModule, backward: fx.GraphModule) -> dict[str, int]:
    """Block -> how many of its forward ops the backward computes again (for reports): the
    backward's call nodes that carry a block recorded by ``tag_recompute``."""
    counts: dict[str, int] = {}
    for node in backward.graph.nodes:
        block = node.meta.get(BLOCK_KEY)
        if node.op == "call_function" and block is not None and node.target is not operator.getitem:
            counts[block] = counts.get(block, 0) + 1
    return counts
