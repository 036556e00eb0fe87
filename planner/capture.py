"""The planner's op graph: the model's forward captured on fake tensors, one node per compute op.

[Note: why torch.export(strict=False) captures the graph]
Non-strict export runs the model's own Python forward under a ``FakeTensorMode``: parameters
and inputs become fake tensors, so no real compute runs and no activation memory is taken
(a 24-block, 350M-parameter GPT built on the meta device exports in about 1.5 s on 2 cores).
What it hands back is what the planner needs and ``make_fx`` does not give: an ATen graph
with a shape on every node, the ``nn_module_stack`` of every node (the module path that
names ops and finds repeated blocks) and a graph signature mapping placeholders to parameter
names. Dynamo's export would do too but breaks on more Python; the planner only reads
shapes, so non-strict tracing is enough.
A region the forward runs under ``torch.autocast`` (even a disabled one; torchtitan's MoE routers run
in fp32 under one) comes back as one higher-order op over a submodule
(``wrap_with_autocast``); its ops are copied into the graph (``_inline_regions``), in the dtypes
autocast gave them. A ``torch.no_grad()`` region stays one op, unpriced.

[Note: what the planner captures of a model's outputs]
Export wants a tree of tensors out, but models hand back ModelOutputs, caches
(Hugging Face's ``DynamicCache`` is no pytree) and plain Python values. The model is
captured inside ``_TensorOutputs``, which returns only the tensor leaves of whatever the
model returns (an opaque object is one non-tensor leaf: dropped) and calls it with
``use_cache=False`` where its forward takes that argument, as training does: a key/value
cache is no output to train through. Python the backend would break the graph on (prints,
``torch._dynamo.graph_break()``, unsupported builtins) runs as it is under non-strict export.

View ops (view, transpose, reshape, ...) move no data: they are folded into the edges, so an
edge runs from the op that produced a tensor to the op that reads it, through any views.

[Note: what the backward saves]
An op's activations are not "its output": they are the tensors its backward reads, which autograd
decides op by op (a Linear keeps its input, not its output; a softmax its output; an add nothing;
flash attention Q, K, V, its output and a logsumexp per row). The planner asks autograd itself:
each op (once per signature) runs on meta tensors shaped as in the graph, with ``requires_grad``
where a gradient flows, and the ``_saved_*`` tensors of the autograd nodes it made are matched to
its inputs and output by storage (``saves_inputs``, ``saves_output``); what matches neither (a
logsumexp, a norm's rstd) is the op's own (``internal_saved``). A tensor is then held from the
forward to the backward if its producer or any reader saves it, once however many do, in its own
dtype: the rule AOTAutograd's partitioner follows when it cuts the joint graph, so that ``dpar
inspect``'s liveness over the real graphs (``compiler/memory.py``) and the planner count the same
tensors. Scaled-dot-product attention runs as the fused kernel (``compiler.costs.flash_attention``)
as a GPU or the CPU runs it, not the math path meta tensors would take.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from torch.multiprocessing.reductions import StorageWeakRef

from dpar.compiler.capture import training_call_kwargs
from dpar.compiler.costs import flash_attention, is_kernel, node_flops
from dpar.compiler.propagation import rules
from dpar.planner.opgraph import ExpertsInfo, Op, OpGraph
from dpar.planner.repeats import collapse_repeats
from dpar.surgery.blocks import block_list, block_settings, with_blocks
from dpar.surgery.expert_parallel import experts_modules
from dpar.core.errors import OptionsError
from dpar.core.torch_internals import OpOverload, no_stack_traces, pytree

aten = torch.ops.aten

# Op kinds: the families of compiler/propagation/rules.py (the ATen ops of a decomposed graph) with the
# composite ops that export keeps whole (aten.linear, softmax.int, scaled_dot_product_attention, ...).
LINEAR = {aten.linear.default}
EMBEDDING = rules.EMBEDDING
NORM = {aten.layer_norm.default, aten.rms_norm.default, aten.group_norm.default} | rules.LAYER_NORM
ATTENTION = {aten.scaled_dot_product_attention.default} | rules.ATTENTION
SOFTMAX = {aten.softmax.int, aten.log_softmax.int} | rules.SOFTMAX
LOSS = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_forward.default, aten.nll_loss_nd.default}
MATMUL = {aten.matmul.default, aten.addmm.default, aten.baddbmm.default} | rules.MATMUL
DROPOUT = {aten.dropout.default, aten.native_dropout.default}
NOT_VIEWS = {aten.clone.default, aten._unsafe_view.default, aten.lift_fresh_copy.default}  # copies that act as views here



class _TensorOutputs(nn.Module):
    """``model`` returning the tensor leaves of its output (see [Note: what the planner captures of a model's outputs])."""

    def __init__(self, model: nn.Module, inputs: int) -> None:
        super().__init__()
        self.model = model
        self.kwargs = training_call_kwargs(model, inputs)

    def forward(self, *inputs: object) -> list[torch.Tensor]:
        out = self.model(*inputs, **self.kwargs)
        return [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]


def capture(model: nn.Module, example_inputs: Sequence[object]) -> torch.export.ExportedProgram:
    """The forward as an ATen graph on fake tensors (see the Notes above); names are ``model``'s own."""
    try:
        with no_stack_traces():
            return torch.export.export(_TensorOutputs(model, len(example_inputs)), tuple(example_inputs), strict=False)
    except GuardOnDataDependentSymNode as error:
        raise OptionsError(
            "the planner runs the forward on fake tensors, which have shapes but no values, and the forward branches "
            f"on a tensor's value ({str(error).splitlines()[0]}); write that branch with torch.where or torch.cond, "
            "or choose a strategy by hand (strategy='ddp', 'zero2', 'fsdp' or 'tp') instead of planning"
        ) from error


def _shape(value: object) -> tuple[int, ...]:
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else ()


def _kind(node: fx.Node, params: list[str]) -> str:
    target = node.target
    if target in LINEAR:
        return "linear"
    if target in EMBEDDING:
        return "embedding"
    if target in NORM:
        return "norm"
    if target in ATTENTION:
        return "attention"
    if target in SOFTMAX:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
        return "softmax" if dim in (-1, len(_shape(node.meta["val"])) - 1) else "other"
    if target in LOSS:
        return "loss"
    if target in MATMUL and not params:
        return "matmul"
    if target in DROPOUT or (isinstance(target, OpOverload) and torch.Tag.pointwise in target.tags):
        return "pointwise"
    if target is aten.cat.default and _along_last(node):
        return "concat"
    return "other"


def _along_last(node: fx.Node) -> bool:
    """A concatenation along the last dimension of per-head values (RoPE's rotate_half: ``cat((-x2, x1), -1)`` of
    ``[batch, heads, seq, head_dim]`` halves): 4-D and more, where a column Linear's split sits on the heads."""
    ndim = len(_shape(node.meta.get("val")))
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return ndim >= 4 and dim in (-1, ndim - 1)


def build_op_graph(model: nn.Module, example_inputs: Sequence[object]) -> OpGraph:
    """Capture ``model`` and turn its ATen graph into ops, edges and parameter owners, repeats collapsed; a model of
    many alike blocks is captured with its first few (see [Note: a capture of the first blocks])."""
    flat_inputs = [x for x in pytree.tree_leaves(tuple(example_inputs)) if isinstance(x, torch.Tensor)]
    batch_size = int(flat_inputs[0].shape[0]) if flat_inputs and flat_inputs[0].dim() else 1
    batch_bytes = sum(x.numel() * x.element_size() for x in flat_inputs if x.dim() and x.shape[0] == batch_size)
    ops = _ops_from_first_blocks(model, example_inputs, batch_size)
    if ops is None:
        ops = _ops(model, model, example_inputs, batch_size)
    graph = collapse_repeats(ops, list(model.named_parameters()), batch_size, batch_bytes)
    tokens = [x for x in flat_inputs if x.dim() >= 2]  # the sequence dim a cp axis splits, as the runtime finds it
    length = int(tokens[0].shape[1]) if tokens and graph.has_attention else 0
    return dataclasses.replace(graph, experts=_experts(model, graph), sequence_length=length)


def _ops(model: nn.Module, captured: nn.Module, example_inputs: Sequence[object], batch_size: int) -> list[Op]:
    """The compute ops of ``captured`` (``model`` or a copy of it sharing its parameters) fed ``example_inputs``,
    parameters named as ``model`` names them."""
    program = capture(captured, example_inputs)
    _inline_regions(program.graph_module)
    names = {id(p): n for n, p in model.named_parameters()}  # tied weights: one (the first) name
    signature = program.graph_signature
    placeholder_param = {ph: names[id(captured.get_parameter(fqn.removeprefix("model.")))] for ph, fqn in signature.inputs_to_parameters.items()}
    user_inputs = set(signature.user_inputs)
    flat_inputs = [x for x in pytree.tree_leaves(tuple(example_inputs)) if isinstance(x, torch.Tensor)]
    user_grad = any(x.requires_grad for x in flat_inputs)
    parameters = dict(model.named_parameters())

    source: dict[fx.Node, object] = {}  # node -> op index, ("param", name), "input" or None
    probed: dict[object, Probe] = {}
    folded: dict[int, tuple] = defaultdict(tuple)  # op index -> kernels of the views and copies folded into its output
    ops: list[Op] = []
    for node in program.graph.nodes:
        if node.op == "placeholder":
            if node.name in placeholder_param:
                source[node] = ("param", placeholder_param[node.name])
            else:
                source[node] = "input" if node.name in user_inputs else None
            continue
        if node.op == "call_function" and _is_check(node):  # no kernel, no value: not an op
            source[node] = None
            continue
        if node.op == "call_function" and _is_view(node):
            source[node] = source.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
            if isinstance(source[node], int) and isinstance(node.meta.get("val"), torch.Tensor):
                # A view moves no data, but a copy folded as one (clone) does, and a view's backward may
                # (slice_backward writes the whole input): its kernels are its producer's.
                kernels = _backward_reads(node, {node.args[0]: ops[source[node]].needs_grad}, set(), probed, set())[3]
                folded[source[node]] += kernels or ()
            continue
        if node.op not in ("call_function", "output"):
            continue
        leaves = node.args[0] if node.op == "output" else (node.args, dict(node.kwargs))
        inputs, in_shapes, in_batched, params, grads, in_sizes = [], [], [], [], [], []
        wants_grad: dict[fx.Node, bool] = {}  # per tensor argument: a gradient flows into it
        param_args: set[fx.Node] = set()
        for arg in pytree.tree_leaves(leaves):
            src = source.get(arg) if isinstance(arg, fx.Node) else None
            if isinstance(src, tuple):
                params.append(src[1])
                wants_grad[arg] = parameters[src[1]].requires_grad
                param_args.add(arg)
            elif isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor):
                inputs.append(src if isinstance(src, int) else -1)
                in_shapes.append(_shape(arg.meta["val"]))
                in_sizes.append(arg.meta["val"].element_size())
                in_batched.append((ops[src].batched if isinstance(src, int) else src == "input") or _batch_shaped(arg, [], batch_size))
                grads.append(ops[src].needs_grad if isinstance(src, int) else src == "input" and user_grad)
                wants_grad[arg] = grads[-1]
        in_grad = any(grads)
        kind = "output" if node.op == "output" else _kind(node, params)
        p_shapes = [tuple(parameters[p].shape) for p in params]
        value = node.meta.get("val")
        saves_inputs, saves_output, internal, kernels = (
            ((False,) * len(inputs), False, 0, None) if kind == "output"
            else _backward_reads(node, wants_grad, param_args, probed, {int(math.prod(parameters[p].shape)) for p in params}
                                 | {int(math.prod(shape)) for shape, b in zip(in_shapes, in_batched) if not b})
        )
        ops.append(
            Op(
                name=node.name,
                kind=kind,
                module=_module_path(node),
                inputs=tuple(inputs),
                input_shapes=tuple(in_shapes),
                input_batched=tuple(in_batched),
                output_shape=() if kind == "output" else _shape(node.meta.get("val")),
                flops=0 if kind == "output" else node_flops(node),
                dtype=_dtype(node, kind),
                params=tuple(params),
                param_shapes=tuple(p_shapes),
                param_grad=any(parameters[p].requires_grad for p in params),
                input_grad=in_grad,
                batched=any(in_batched) or _batch_shaped(node, params, batch_size),
                output_itemsize=value.element_size() if isinstance(value, torch.Tensor) else 0,
                input_itemsizes=tuple(in_sizes),
                param_itemsizes=tuple(parameters[p].element_size() for p in params),
                saves_inputs=saves_inputs,
                saves_output=saves_output,
                internal_saved=internal,
                kernels=kernels,
            )
        )
        source[node] = len(ops) - 1
    return [dataclasses.replace(op, kernels=op.kernels + folded[i]) if folded.get(i) and op.kernels is not None else op
            for i, op in enumerate(ops)]


AUTOCAST_REGION = "wrap_with_autocast"
"""The higher-order op export keeps a ``torch.autocast`` region of the forward in: the region's ops in a submodule,
the autocast settings and the submodule first among its arguments, then what the region reads. (A
``torch.no_grad()`` region, ``wrap_with_set_grad_enabled``, stays one op: its ops would be priced as needing
gradients.)"""


def _inline_regions(gm: fx.GraphModule) -> None:
    """The ops of each autocast region (``AUTOCAST_REGION``) in ``gm``'s own graph, in place of the one op that calls
    them: priced as one opaque op, a forward run under ``torch.autocast`` (even disabled) was an op graph of no FLOPs
    and no activations. The copied ops keep their values (in the dtypes autocast gave them) and module paths."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or getattr(node.target, "__name__", "") != AUTOCAST_REGION:
            continue
        at = next(i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr")
        region = getattr(gm, node.args[at].target)
        _inline_regions(region)
        inner = list(region.graph.nodes)
        if any(n.op in ("get_attr", "call_module") for n in inner) or any(u.target is not operator.getitem for u in node.users):
            continue  # a region holding constants or modules of its own, or read whole: left as one op
        values: dict[fx.Node, object] = dict(zip((n for n in inner if n.op == "placeholder"), node.args[at + 1:]))
        with graph.inserting_before(node):
            for n in inner:
                if n.op == "output":
                    results = n.args[0]
                elif n.op != "placeholder":
                    values[n] = graph.node_copy(n, lambda a: values[a])
        for user in list(node.users):
            result = results[user.args[1]]
            user.replace_all_uses_with(values.get(result, result) if isinstance(result, fx.Node) else result)
            graph.erase_node(user)
        graph.erase_node(node)


# [Note: a capture of the first blocks]
# Exporting a model costs about 0.1 s a block on 2 cores at Llama-3-70B's width (8 s of the 9 s its op graph took, all
# 80 blocks, 2026-12-01), and the planner prices one block of each parity anyway (repeats.py). So a model whose blocks
# are one numbered list of alike blocks (the same parameters, buffers, module classes and settings: ``surgery.blocks``;
# no hooks; no parameter shared with another block or outside) is exported with its first ``FIRST_BLOCKS`` blocks
# (``surgery.blocks.with_blocks``: the model's own modules, nothing copied), and its op list made whole again: block k
# (from ``FIRST_BLOCKS`` on) is a copy of the last kept block of k's parity, its module, its parameters and its ops'
# names renumbered as the whole export numbers them, reading the block before it where its original read the one before
# that; the ops after the blocks read the last block. That is only sound where the kept blocks show it is: the ops run
# before, through and after the blocks in that order, every kept block after the first is the same op list (kinds,
# shapes, names' stems, what it reads: its own ops, the block before it, the ops before the blocks), and the ops after
# the blocks read no block but the last; otherwise, or where the forward will not run the first blocks alone (raises),
# the model is exported whole. What a forward does at a block the copy does not reach (``if i == 40``) no cut capture
# can see: the count on the compiled graphs (api/graph_pricing.py) makes the same assumption. Checked against the whole
# export op for op, every field (2026-12-01): Hugging Face's Llama, GPT-2, BERT and Mixtral at 9 blocks,
# examples/gpt.py's GPT (fused and split q/k/v), Llama-3-8B and -70B at their sizes on meta (70B's op graph in 1.5 s
# instead of 9.1 s); T5 (two block lists), torchtitan's models (an ``nn.ModuleDict``) and Qwen3-MoE's router loss (read
# off every block) are exported whole. The pipeline search prices each block as a stage of its own from such a capture
# too (pipeline.py's ``_priced_from_first_blocks``: the middle blocks as the last kept middle block of their parity, the
# last block as the kept last, which holds what follows the blocks), equal field for field to the whole capture's prices
# on Hugging Face's Llama, GPT-2 and Mixtral, the GPT and Llama-3-8B (its prices in 3.5 s instead of 8.5 s; 405B's
# pipeline search in 41 s instead of 56 s, its export 1 s instead of 19 s). tests/test_planner_scale.py holds both
# comparisons.

FIRST_BLOCKS = 4
"""Blocks a cut capture keeps: two of each parity, so that each copied block has a kept one of its parity that
reads a block, not the ops before the blocks."""


def alike_blocks(model: nn.Module) -> tuple[str, int] | None:
    """(the block list's path, how many blocks) where ``model`` is many alike blocks, which a capture of its first
    ``FIRST_BLOCKS`` may stand for (see the Note); None otherwise."""
    found = block_list(model)
    if found is None or len(found[1]) < 2 * FIRST_BLOCKS or not _alike(model, *found):
        return None
    return found[0], len(found[1])


def _ops_from_first_blocks(model: nn.Module, example_inputs: Sequence[object], batch_size: int) -> list[Op] | None:
    """The model's ops from a capture of its first blocks, or None where that would not be its ops (see the Note)."""
    found = alike_blocks(model)
    if found is None:
        return None
    path, total = found
    try:
        ops = _ops(model, with_blocks(model, path, range(FIRST_BLOCKS)), example_inputs, batch_size)
    except Exception:  # noqa: BLE001 - a forward that runs only its whole block list: the whole export says what it says
        return None
    return _repeated(ops, path, total)


def _alike(model: nn.Module, path: str, container: nn.Module) -> bool:
    """Every block holds what the first does (relative names, shapes, dtypes, trained or not; buffers; module
    classes; settings), no block has hooks, and each block's parameters are its own (named in it by the model)."""
    names = {id(p): n for n, p in model.named_parameters()}
    blocks = list(container)

    def held(block: nn.Module) -> tuple:
        return (tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
                tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()),
                tuple(type(m) for m in block.modules()))

    own = all(names.get(id(p)) == f"{path}.{i}.{n}" for i, block in enumerate(blocks)
              for n, p in block.named_parameters(remove_duplicate=False))
    hooked = any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                 for block in blocks for m in block.modules())
    first = held(blocks[0])
    return own and not hooked and all(held(b) == first for b in blocks[1:]) and len(set(block_settings(blocks))) == 1


def block_index(name: str, path: str) -> int | None:
    """The number of the block of the list at ``path`` that ``name`` (a module's or parameter's) is in, if any."""
    index = name[len(path) + 1:].partition(".")[0] if name.startswith(path + ".") else ""
    return int(index) if index.isdigit() else None


def parity_source(k: int) -> int:
    """The kept block that block ``k`` (``FIRST_BLOCKS`` or later) is made from: the last kept one of its parity."""
    return FIRST_BLOCKS - 2 + (k - FIRST_BLOCKS) % 2


def _repeated(ops: list[Op], path: str, total: int) -> list[Op] | None:
    """``ops`` of a capture of the first blocks of ``path`` made whole for ``total`` blocks (see the Note); None
    where the kept blocks do not show the copies would be right."""
    where = [block_index(op.module, path) for op in ops]
    inside = [i for i, b in enumerate(where) if b is not None]
    if not inside:
        return None
    first, last = inside[0], inside[-1]
    size, rest = divmod(last + 1 - first, FIRST_BLOCKS)
    if rest or where[first:last + 1] != [b for b in range(FIRST_BLOCKS) for _ in range(size)]:
        return None
    start = lambda b: first + b * size  # noqa: E731

    def reads(i: int) -> tuple | None:
        """How op i of a block reads: its own ops, the block before it's, the ops before the blocks (by position)."""
        b, found = where[i], []
        for u in ops[i].inputs:
            if u < first:
                found.append(("before", u))
            elif where[u] == b:
                found.append(("own", u - start(b)))
            elif where[u] == b - 1:
                found.append(("previous", u - start(b - 1)))
            else:
                return None
        return tuple(found)

    def relative(b: int) -> list[tuple] | None:
        own = f"{path}.{b}"
        found = [(dataclasses.replace(ops[i], name=_stem(ops[i].name)[0], module=moved(ops[i].module, own, ""),
                                      params=tuple(moved(p, own, "") for p in ops[i].params), inputs=()), reads(i))
                 for i in range(start(b), start(b) + size)]
        return None if any(r is None for _, r in found) else found

    shape = relative(1)
    if shape is None or any(relative(b) != shape for b in range(2, FIRST_BLOCKS)):
        return None
    after = ops[last + 1:]
    if any(last >= u >= first and where[u] != FIRST_BLOCKS - 1 for op in after for u in op.inputs):
        return None
    per_block: dict[str, int] = defaultdict(int)
    for op in ops[start(1):start(2)]:
        per_block[_stem(op.name)[0]] += 1

    whole = list(ops[:last + 1])
    for k in range(FIRST_BLOCKS, total):
        source = parity_source(k)
        at = len(whole)
        for op in ops[start(source):start(source) + size]:
            whole.append(dataclasses.replace(
                op, name=_renumbered(op.name, (k - source) * per_block[_stem(op.name)[0]]),
                module=moved(op.module, f"{path}.{source}", f"{path}.{k}"),
                params=tuple(moved(p, f"{path}.{source}", f"{path}.{k}") for p in op.params),
                inputs=tuple(u if u < first else at + u - start(source) if where[u] == source
                             else at - size + u - start(source - 1) for u in op.inputs)))
    shift = (total - FIRST_BLOCKS) * size
    whole += [dataclasses.replace(op, name=_renumbered(op.name, (total - FIRST_BLOCKS) * per_block[_stem(op.name)[0]]),
                                  inputs=tuple(u if u < first else u + shift for u in op.inputs)) for op in after]
    return whole


def _stem(name: str) -> tuple[str, int]:
    """``linear_12`` -> (``linear``, 12), ``linear`` -> (``linear``, 0): how FX numbers the nodes of one stem."""
    stem, _, number = name.rpartition("_")
    return (stem, int(number)) if stem and number.isdigit() else (name, 0)


def _renumbered(name: str, by: int) -> str:
    stem, number = _stem(name)
    return name if not by else f"{stem}_{number + by}"


def moved(name: str, old: str, new: str) -> str:
    """``name`` (a module's or parameter's) under ``new`` where it is under ``old``; ``new`` empty: relative to ``old``."""
    if name != old and not name.startswith(old + "."):
        return name
    return new + name[len(old):] if new else name[len(old):]


def _experts(model: nn.Module, graph: OpGraph) -> tuple[ExpertsInfo, ...]:
    """The model's routed experts modules, with the (token, expert) rows their first op reads: its first 2-D
    activation input, ``(rows, width)``; and the size of their output, the last op of the module that op is in."""
    owner = {p.name: p.op for p in graph.params}
    found = []
    for name, module in experts_modules(model).items():
        params = tuple(f"{name}.{p}" for p, _ in module.named_parameters(recurse=False))
        op = next((graph.ops[owner[p]] for p in params if owner.get(p) is not None), None)
        read = None if op is None else next(
            ((shape, size) for shape, size in zip(op.input_shapes, op.input_itemsizes) if len(shape) == 2), None)
        if read is not None:
            (rows, width), itemsize = read
            output = [o.output_numel for o in graph.ops if o.module == op.module][-1]
            found.append(ExpertsInfo(name, params, module.num_experts, rows, width, itemsize, output))
    return tuple(found)


def _backward_reads(
    node: fx.Node, wants_grad: dict[fx.Node, bool], param_args: set[fx.Node], probed: dict[object, Probe],
    param_numels: set[int],
) -> Probe:
    """(per activation input: saved, output saved, bytes of the op's own saved tensors, its kernels): see [Note:
    what the backward saves] and [Note: an op's kernels]. Parameters are held as state anyway and are not reported."""
    tensors = [a for a in pytree.tree_leaves((node.args, dict(node.kwargs))) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    activations = [a for a in tensors if a not in param_args]  # in the order of the op's ``inputs``
    key = (node.target, tuple((_shape(a.meta["val"]), a.meta["val"].dtype, wants_grad.get(a, False)) for a in tensors),
           tuple(repr(a) for a in pytree.tree_leaves((node.args, dict(node.kwargs))) if not isinstance(a, fx.Node)))
    if key in probed:
        return probed[key]
    fallback = (tuple(wants_grad.get(a, False) for a in activations), False, 0, None)
    target = flash_attention if node.target in ATTENTION and not node.kwargs.get("enable_gqa") else node.target
    made: dict[fx.Node, torch.Tensor] = {}

    def fresh(a: object) -> object:
        if not isinstance(a, fx.Node):
            return a
        value = a.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return value
        if a not in made:
            t = torch.empty_strided(_shape(value), tuple(int(s) for s in value.stride()), dtype=value.dtype, device="meta")
            made[a] = t.requires_grad_(wants_grad.get(a, False) and (t.is_floating_point() or t.is_complex()))
        return made[a]

    try:
        args, kwargs = pytree.tree_map(fresh, (node.args, dict(node.kwargs)))
        if target is flash_attention:
            kwargs = {k: v for k, v in kwargs.items() if k != "enable_gqa"}
        with torch.enable_grad():
            out = target(*args, **kwargs)
    except Exception:  # an op that will not run on meta: assume its backward reads every input a gradient flows to
        probed[key] = fallback
        return fallback
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    saved = _saved_tensors([t.grad_fn for t in outs if t.grad_fn is not None])
    storage = lambda t: StorageWeakRef(t.untyped_storage())  # noqa: E731
    saved_keys = {storage(t): t for t in saved}
    inputs = [storage(made[a]) for a in activations if a in made]
    output_keys = {storage(t) for t in outs}
    others = {storage(t) for a, t in made.items() if a not in activations} | set(inputs) | output_keys
    internal = sum(int(t.untyped_storage().nbytes()) for k, t in saved_keys.items() if k not in others)
    try:
        kernels = _kernels(target, args, kwargs, made, outs, param_numels | {int(made[a].numel()) for a in made if a not in activations})
    except Exception:  # priced by the op's closed form instead (``CostModel.op_cost``)
        kernels = None
    found = (tuple(k in saved_keys for k in inputs), any(k in saved_keys for k in output_keys), internal, kernels)
    probed[key] = found
    return found


def _kernels(target: object, args: object, kwargs: dict, made: dict[fx.Node, torch.Tensor], outs: list[torch.Tensor],
             fixed_numels: set[int]) -> tuple[Kernel, ...]:
    """[Note: an op's kernels]
    The ATen kernels one op runs, forward and backward, as AOTAutograd would trace them into the graphs
    ``dpar inspect`` prices: the op and ``torch.autograd.grad`` of it traced by ``make_fx`` on meta
    tensors (composite ops decompose: a Linear is ``t`` and ``mm``, a cross-entropy ``_log_softmax`` and
    ``nll_loss_forward``, whose backwards are their own kernels, not "one more forward per gradient").
    Each kernel is (phase, the ATen op, FLOPs by ``compiler.costs.node_flops``, dtype, bytes that carry the batch,
    bytes that do not), priced by the one roofline at a rank's share of the batch (``CostModel``). A
    tensor of a parameter's size (the weight, its gradient) does not carry the batch."""
    tensors = list(made.values())
    wanted = [t for t in tensors if t.requires_grad]
    differentiable = [o for o in outs if o.requires_grad]
    tangents = [torch.empty_like(o) for o in differentiable]

    def rebuild(values: list[torch.Tensor]) -> tuple[object, dict]:
        swap = dict(zip(map(id, tensors), values))
        return pytree.tree_map(lambda a: swap.get(id(a), a) if isinstance(a, torch.Tensor) else a, (args, kwargs))

    def forward(*values: torch.Tensor) -> object:
        a, k = rebuild(list(values))
        return target(*a, **k)

    def joint(*values: torch.Tensor) -> object:
        inputs, grads_out = list(values[: len(tensors)]), list(values[len(tensors):])
        a, k = rebuild(inputs)
        out = target(*a, **k)
        leaves = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        need = [t for t in inputs if t.requires_grad]
        grads = torch.autograd.grad(leaves, need, grads_out, allow_unused=True) if leaves and need else ()
        return out, grads

    with torch.enable_grad():
        forward_nodes = _compute_nodes(make_fx(forward)(*tensors))
        joint_nodes = _compute_nodes(make_fx(joint)(*tensors, *tangents)) if wanted and differentiable else forward_nodes
    found = []
    for i, node in enumerate(joint_nodes):
        values = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
        values = [v for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor)]
        nbytes = [(int(v.numel()) * v.element_size(), int(v.numel()) not in fixed_numels) for v in values]
        out = node.meta.get("val")
        dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
        found.append((
            "forward" if i < len(forward_nodes) else "backward", str(node.target), node_flops(node), dtype,
            sum(b for b, batched in nbytes if batched), sum(b for b, batched in nbytes if not batched),
        ))
    return tuple(found)


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes ``dpar inspect`` prices (``compiler.costs.is_kernel``)."""
    return [n for n in gm.graph.nodes if is_kernel(n)]


Kernel = tuple[str, str, int, torch.dtype, int, int]  # phase, ATen op, FLOPs, dtype, bytes carrying the batch, other bytes
Probe = tuple[tuple[bool, ...], bool, int, "tuple[Kernel, ...] | None"]


def _saved_tensors(roots: list[object]) -> list[torch.Tensor]:
    """Every tensor the autograd nodes reachable from ``roots`` saved (``_saved_*``), up to the leaves."""
    found, seen, stack = [], set(), list(roots)
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen or type(fn).__name__ == "AccumulateGrad":
            continue
        seen.add(id(fn))
        for name in dir(fn):
            if name.startswith("_saved_"):
                value = getattr(fn, name, None)
                found += [t for t in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(t, torch.Tensor)]
        stack += [nxt for nxt, _ in fn.next_functions]
    return found


def _dtype(node: fx.Node, kind: str) -> torch.dtype:
    """The dtype an op computes in, which picks its peak: its output's (a loss's or an index op's: its float input's)."""
    values = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    floats = [v.dtype for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return floats[0] if floats else torch.float32


def _batch_shaped(node: fx.Node, params: list[str], batch_size: int) -> bool:
    """An op (or an input it reads through views) shaped by the batch without reading it: its dim 0 is
    the batch's.

    Hugging Face builds the causal mask from ``arange`` and the input's *shape* ([B, 1, S, S]): no
    edge from the input reaches it, yet each rank builds its own rows' mask only. Priced as
    unbatched, every rank built and read the global batch's mask (at 512 ranks, Llama-3-70B's
    per-rank compute grew by 160 ms with the world: a per-rank cost must not depend on N)."""
    value = node.meta.get("val")
    return node.op == "call_function" and not params and batch_size > 1 and isinstance(value, torch.Tensor) and value.dim() > 0 and int(value.shape[0]) == batch_size


def _is_check(node: fx.Node) -> bool:
    """Export's runtime assertions (``aten._assert_tensor_metadata``, ``_assert_scalar``, ...): checks, no kernel.

    Priced as ops, they cost one read of the checked tensor each: 1.2 ms a Llama-3-8B block (fwd + bwd)
    that no GPU spends."""
    return getattr(node.target, "__name__", "").startswith("_assert")


def _is_view(node: fx.Node) -> bool:
    return node.target is operator.getitem or getattr(node.target, "is_view", False) or node.target in NOT_VIEWS


def _module_path(node: fx.Node) -> str:
    """The module path in the user's model (under ``_TensorOutputs.model``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0].partition(".")[2] if stack else ""
