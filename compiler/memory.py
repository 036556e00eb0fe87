"""What a graph holds while it runs: the bytes of its live tensors, by liveness over its nodes.

Shared by ``dpar.inspect`` (a strategy's per-rank memory, ``inspection/memory.py``) and the pipeline
stage costs (``pipeline_parallel/costs.py``, which ``dpar.planner`` and ``dpar.inspect`` both read).

[Note: a step's live bytes]
During the step, graph intermediates come on top of the state a rank keeps, read from the graphs
by liveness (``step_peak``): at the moment their sum peaks, the part that is gathered parameters
(an all-gather's buffer and the copies and views of it the graph makes, padded to N * ceil(d0 / N)
rows) and the rest ("activations": saved activations, full gradients before their reduce-scatter
or all-reduce, bucket buffers). How long gathered parameters live is the strategy's doing and the
graphs show it: fsdp frees each after its last use in the forward and gathers again in the
backward, so at most the in-flight gathers (``max_inflight_gathers``) and the bucket in use are
live; zero2 saves what the backward reads from the forward to the backward.

[Note: gradients live to the optimizer]
A backward's outputs are the gradients (ddp: all-reduced; zero2/fsdp: the reduce-scattered shards),
stored as ``.grad`` until the optimizer steps, and ``zero_grad(set_to_none=True)`` frees them before
the next step. ``Live.gathered``/``activations`` are the intermediates at their own peak, gradients
aside (a rank's ``gradients`` are counted in full beside them); ``Live.step`` is the step's peak with
each gradient counted from the node that produces it: what a rank holds above what it held when the
step began. Where the gradients outweigh the activations (a large model, a small batch) that peak is
at the end of the backward, not its start (HF Llama 100M, 2x128 tokens a rank, ddp: 237 MiB of
activations at their peak, 396 MiB at the step's, 396.1 MiB measured).

[Note: gloo stages its gathers and reductions]
On gloo an all-gather holds its gathered bytes twice: gloo's own gather copied out of a buffer of the output's size
that it allocated on its worker thread (measured, benchmarks/measured_vs_modelled.py: a 2.5 MiB buffer on gloo's
thread for each 2.5 MiB gather of an HF Llama's blocks under fsdp), and the all-reduce dpar runs instead
([Note: no all-gather on gloo]) reduces a copy of the zero-padded block, both of the gathered size at its issue.
``reduce_scatter_tensor`` likewise reduces through a buffer of its input's size, the whole unscattered gradient:
2 ranks, a 12 MiB input, the allocator's peak over the collective and its wait is 18 MiB (the 6 MiB result and
12 MiB staged); an all-gather of 6 MiB per rank peaks at 24 (12 + 12), an all-reduce at its 12 MiB result alone.
``staged_collectives=True`` counts those buffers from the collective's issue to its wait; NCCL works in
place, and the GPU presets need none.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from dpar.compiler.collectives import WAIT
from dpar.compiler.propagation.redistribute import ACTIVATION_COLLECTIVE
from dpar.core.torch_internals import C10D_FUNCTIONAL

OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, "none": 0}
"""Tensors of a parameter's size (and dtype) each optimizer keeps per parameter."""

aten = torch.ops.aten

_KEEPS_GATHERED = {
    WAIT, operator.getitem, aten.view.default, aten._unsafe_view.default, aten.slice.Tensor,
    aten.clone.default, aten.t.default, aten.alias.default, aten.detach.default,
    aten._to_copy.default, aten.split_with_sizes.default, aten.permute.default,
}
"""Ops whose result is still the gathered parameter: a copy, cast or view of it alone."""


@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    """The bytes a step holds above its state just after one node ran: the memory timeline."""

    graph: int  # which (forward, backward) pair of the step
    phase: str  # "forward" or "backward"
    node: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Live:
    """Bytes of graph tensors alive at one moment: gathered parameters and everything else."""

    gathered: int = 0
    activations: int = 0
    step: int = 0
    """Set by ``step_peak`` only: the most bytes the step holds at once above its state, the gradients
    the backward has produced by then included (see [Note: gradients live to the optimizer])."""
    timeline: tuple[MemoryPoint, ...] = ()
    """Set by ``step_peak`` only: what ``step`` is the most of, after each node of the step."""
    phases: tuple[tuple[int, int], ...] = ()
    """Set by ``step_peak`` only: (gathered, activations) at the forward graphs' peak and at the backward graphs'
    (the higher is this peak): each grows with the model's depth at its own rate, so a count extrapolated by
    block extrapolates each (api/graph_pricing.py)."""

    @property
    def total(self) -> int:
        return self.gathered + self.activations

    def __add__(self, other: Live) -> Live:
        return Live(self.gathered + other.gathered, self.activations + other.activations)

    def __sub__(self, other: Live) -> Live:
        return Live(self.gathered - other.gathered, self.activations - other.activations)


def _higher(a: Live, b: Live) -> Live:
    return b if b.total > a.total else a


Storage = tuple[object, int]  # (identity, bytes)


def storages_of(node: fx.Node) -> list[Storage]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [
        (StorageWeakRef(v.untyped_storage()), int(v.untyped_storage().nbytes()))
        for v in vals
        if isinstance(v, torch.Tensor)
    ]


def _gathered_nodes(gm: fx.GraphModule, gathered_inputs: set[str]) -> set[fx.Node]:
    """All-gathers, the placeholders named in ``gathered_inputs``, and copies, casts and views of them."""
    gathered: set[fx.Node] = set()
    for node in gm.graph.nodes:
        parameter_gather = (
            node.target is C10D_FUNCTIONAL.all_gather_into_tensor.default
            and not node.meta.get(ACTIVATION_COLLECTIVE)  # tensor parallel's gathers carry activations
        )
        if parameter_gather or (node.op == "placeholder" and node.name in gathered_inputs):
            gathered.add(node)
        elif node.target in _KEEPS_GATHERED and node.all_input_nodes and all(
            a in gathered for a in node.all_input_nodes
        ):
            gathered.add(node)
    return gathered


_HOLD_INPUT = {
    C10D_FUNCTIONAL.all_gather_into_tensor.default, C10D_FUNCTIONAL.reduce_scatter_tensor.default,
    C10D_FUNCTIONAL.all_to_all_single.default,
}
"""[Note: a collective holds its input]
A functional all-gather, reduce-scatter or all-to-all hands its input to the library as it is: the work
keeps it until the collective is done, so it lives to the collective's wait, whatever reads it last in the
graph (a reduce-scatter's unscattered gradient bucket, under fsdp, past the backward's next block: 2 gloo
ranks, HF Llama 25M with selective recomputation, measured peaks 137-168 MiB over nine steps, modelled 138
without it and 156 with it; keep 162-170 measured, 156 and 174 modelled). An all-reduce and a broadcast
work on a copy they make at once (functional collectives are out of place), so their input dies at its
last reader."""


@dataclasses.dataclass(frozen=True)
class Liveness:
    peak: Live
    live_at_end: Live
    counted: dict[object, Live]  # storage -> bytes counted, by kind (nothing: parameter shard or input)
    after_node: tuple[tuple[str, int], ...]  # (node, bytes alive once it ran, before what it last read is freed)


def liveness(
    gm: fx.GraphModule,
    same_as: dict[object, object],
    counted_inputs: set[str],
    gathered_inputs: set[str],
    exclude_outputs: bool,
    staged_collectives: bool = False,
) -> Liveness:
    """Bytes of storages alive over ``gm``'s nodes, a storage dying after its last reader.

    Placeholders count only if named in ``counted_inputs``; other placeholders (and
    views of them) are parameters (or their shards) or user data. ``same_as`` renames
    storages so that a backward input is the forward storage it was saved from;
    ``gathered_inputs`` are the inputs that are gathered parameters. A storage the
    graph returns stays alive to the end, or (``exclude_outputs``, for the gradients
    a backward returns) is not counted at all.
    """
    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[arg] = i
        if node.target is WAIT and node.args[0].target in _HOLD_INPUT:  # see [Note: a collective holds its input]
            for arg in node.args[0].all_input_nodes:
                last_use[arg] = i

    same_as = dict(same_as)
    for node in nodes:  # a wait returns the collective's own buffer (fake tensors give it a new one)
        if node.target is WAIT:
            for (key, _), (arg_key, _) in zip(storages_of(node), storages_of(node.args[0])):
                same_as[key] = same_as.get(arg_key, arg_key)

    def storages(node: fx.Node) -> list[Storage]:
        return [(same_as.get(key, key), nbytes) for key, nbytes in storages_of(node)]

    gathered = _gathered_nodes(gm, gathered_inputs)
    kept = {key for n in gm.graph.output_node().all_input_nodes for key, _ in storages(n)}
    counted: dict[object, Live] = {}
    alive_until: dict[object, int] = {}
    staging = _staging_buffers(nodes) if staged_collectives else {}
    live = peak = Live()
    after_node = []
    for i, node in enumerate(nodes):
        skip = node.op == "placeholder" and node.name not in counted_inputs
        for key, nbytes, end in staging.get(node, ()):  # see [Note: gloo stages its gathers and reductions]
            counted[key] = Live(nbytes, 0) if node in gathered else Live(0, nbytes)
            live += counted[key]
            alive_until[key] = end
        for key, nbytes in storages(node):
            if key not in counted:
                nbytes = 0 if skip or (exclude_outputs and key in kept) else nbytes
                counted[key] = Live(nbytes, 0) if node in gathered else Live(0, nbytes)
                live += counted[key]
            if counted[key].total:
                end = len(nodes) if key in kept else last_use.get(node, i)
                alive_until[key] = max(alive_until.get(key, i), end)
        peak = _higher(peak, live)
        after_node.append((node.name, live.total))
        for key in [k for k, end in alive_until.items() if end == i]:
            live -= counted[key]
            del alive_until[key]
    return Liveness(peak, live, counted, tuple(after_node))


def _staging_buffers(nodes: list[fx.Node]) -> dict[fx.Node, list[tuple[object, int, int]]]:
    """Per all-gather and reduce-scatter: (a key of its own, the gathered output's or the unscattered input's
    bytes, the index of its wait) for gloo's buffer."""
    index = {node: i for i, node in enumerate(nodes)}
    found: dict[fx.Node, list[tuple[object, int, int]]] = {}
    for node in nodes:
        if node.target is C10D_FUNCTIONAL.all_gather_into_tensor.default:
            staged = node
        elif node.target is C10D_FUNCTIONAL.reduce_scatter_tensor.default and isinstance(node.args[0], fx.Node):
            staged = node.args[0]
        else:
            continue
        waits = [index[u] for u in node.users if u.target is WAIT]
        nbytes = sum(n for _, n in storages_of(staged))
        found[node] = [(("staging", node), nbytes, min(waits, default=index[node]))]
    return found


@dataclasses.dataclass(frozen=True)
class _SavedInputs:
    """How a backward graph's inputs relate to what its forward saved."""

    same_as: dict[object, object]  # backward storage -> the forward storage it is
    counted: set[str]  # placeholders that are activations (or gathered parameters) saved by the forward
    gathered: set[str]  # those of them that are gathered parameters


def _saved_inputs(forward: fx.GraphModule, fw: Liveness, backward: fx.GraphModule) -> _SavedInputs:
    forward_nodes = {n.name: n for n in forward.graph.nodes}
    saved = _SavedInputs({}, set(), set())
    for node in backward.graph.nodes:
        if node.op != "placeholder":
            continue
        source = forward_nodes.get(node.name)
        if source is None:  # tangents: made by the caller of backward
            saved.counted.add(node.name)
            continue
        for (key, _), (fw_key, _) in zip(storages_of(node), storages_of(source)):
            saved.same_as[key] = fw_key
        held = [fw.counted.get(k, Live()) for k, _ in storages_of(source)]
        if source.op != "placeholder" and any(h.total for h in held):
            saved.counted.add(node.name)
            if any(h.gathered for h in held):
                saved.gathered.add(node.name)
    return saved


def saved_activations(pairs: Sequence[tuple[fx.GraphModule, fx.GraphModule | None]]) -> int:
    """Bytes the forward graphs hand their backwards, gathered parameters aside: the tensors held from the forward
    to the backward (and each forward's loss), as ``dpar inspect`` and ``dpar plan`` report them."""
    return sum(liveness(fw, {}, set(), set(), exclude_outputs=False).live_at_end.activations for fw, bw in pairs if bw is not None)


def step_peak(pairs: Sequence[tuple[fx.GraphModule, fx.GraphModule | None]], staged_collectives: bool = False) -> Live:
    """Peak live bytes over the forward graphs in order, then the backward graphs in reverse.

    What a forward graph returns (saved activations, gathered parameters kept
    for the backward, outputs) stays live until its backward; parameters (or
    their shards), user inputs and views of them are not counted. ``staged_collectives``:
    see [Note: gloo stages its gathers and reductions].
    """
    peak = saved = Live()
    forwards = []
    timeline = []
    for g, (forward, _) in enumerate(pairs):
        fw = liveness(forward, {}, set(), set(), exclude_outputs=False, staged_collectives=staged_collectives)
        peak = _higher(peak, saved + fw.peak)
        timeline += [MemoryPoint(g, "forward", name, saved.total + nbytes) for name, nbytes in fw.after_node]
        saved += fw.live_at_end
        forwards.append(fw)
    forward_peak, backward_peak = peak, Live()
    step, produced = peak.total, 0  # see [Note: gradients live to the optimizer]
    for g, ((forward, backward), fw) in reversed(list(enumerate(zip(pairs, forwards)))):
        saved -= fw.live_at_end
        if backward is None:
            continue
        inputs = _saved_inputs(forward, fw, backward)
        bw = liveness(backward, inputs.same_as, inputs.counted, inputs.gathered, exclude_outputs=True,
                      staged_collectives=staged_collectives)
        backward_peak = _higher(backward_peak, saved + bw.peak)
        peak = _higher(peak, backward_peak)
        held = liveness(backward, inputs.same_as, inputs.counted, inputs.gathered, exclude_outputs=False,
                        staged_collectives=staged_collectives)
        step = max(step, saved.total + produced + held.peak.total)
        timeline += [MemoryPoint(g, "backward", name, saved.total + produced + nbytes) for name, nbytes in held.after_node]
        produced += held.live_at_end.total
    phases = tuple((p.gathered, p.activations) for p in (forward_peak, backward_peak))
    return dataclasses.replace(peak, step=max(step, peak.total), timeline=tuple(timeline), phases=phases)
