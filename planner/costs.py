"""The planner's cost model: sympy closed forms, evaluated for every op, candidate and layout.

[Note: the planner's cost model]
Compute is a roofline per kernel (``dpar.compiler.costs.roofline``, the one the inspector prices
each node with): ``max(F / peak(dtype), M / mem_bandwidth)``. The kernels are the ATen ops each op
runs forward and backward as autograd traces them ([Note: an op's kernels] in ``capture.py``), with
F their FLOPs (``costs.node_flops``, the one count) and M the bytes they read and write in their own
dtype, split as the op is (the batch over the data-parallel degree D, everything over the tp degree
T where the candidate splits the op; a replicated weight is read whole by every rank). An op whose
kernels could not be traced falls back to one roofline on the op and one more forward per gradient
it produces.

Communication is the α-β ring model of ``dpar.compiler.costs`` per mesh dimension,
each with its own α and β (``DeviceSpec.links``: node-local or across nodes). Data-parallel collectives run per bucket, one bucket per
numbered block (``blocks.3``) and one for the rest, as dpar's sharded runtime buckets them:
their α terms depend on the layout only, their β terms on each parameter's tp placement. A collective over several
data-parallel dimensions runs as dpar runs it: one ring over all their ranks (``parallelize`` folds the dp axes into
one group), on the slowest of their links (a ring across nodes is as fast as its inter-node hops), which is the
link ``dpar inspect`` prices that group on (``DeviceSpec.link_among``).

Memory and communication are in the model's own dtypes, as the step runs them and as ``dpar inspect``
counts them (no mixed-precision convention the run does not use): a parameter of E bytes an element
takes E for itself, E for its gradient and E for each AdamW moment (``compiler.memory.OPTIMIZER_STATES``),
so an fp32 parameter replicated costs 16Ψ, and under zero2 and fsdp, which keep shards of all three
at rest, 16Ψ/D; zero2 also holds every parameter gathered from its forward to its backward (E·Ψ),
fsdp the root's (embedding, head: its backward does not gather them again) and one block at a time
(that block is not counted here). Collective payloads are the parameters' (gradients')
own bytes. Activations are the tensors the backward reads (see [Note: what the backward saves] in
``capture.py``), each once, in its own dtype.

Data-parallel kernels: what dpar's graphs run beside the model's ops, memory-bound, priced as
reads plus writes at the memory bandwidth (``dp_kernel_bytes``): ddp divides every gradient by D
before the all-reduce and copies those below the bucket cap into their bucket; zero2 and fsdp copy
each rank's shard into the all-gather's buffer and the gathered parameter out of it in the forward,
copy the gradients into the reduce-scatter's buffer and divide them; fsdp gathers and copies again
in the backward (every block's parameters; the root's stay gathered from the forward). The
backward's adds of the gradients of a tensor read by several ops are priced too
(``accumulation_seconds``).

The batch: each rank is fed its own rows (see [Note: which mesh axes split the data] in
``plan.py``), and the ranks of a tp group compute on the same rows, so a tp layout first
all-gathers the group's slices of the inputs that carry the batch (their own dtype, not bf16).

Expert parallelism (an ``ep`` axis, planner/layout.py): each routed experts module's parameters take 1/ep per rank,
their data-parallel collectives, state sharding and α terms run over the ``dp`` axes only (the rest's over ``dp`` and
``ep``), and each module exchanges its (token, expert) rows as the runtime does ([Note: routed tokens in fixed-size
buffers]): ep x (its rows / D) x width bytes per all-to-all, two forward (out and back) plus one of the int64 expert
ids, two backward, on the critical path like tp's. The experts' compute is priced as the op graph holds it, at a
balanced routing. Under a tp axis the experts of a module whose count tp divides are spread over it by expert, as
the runtime spreads them ([Note: experts spread over a tensor-parallel group]): 1/tp of their parameters and of the
work of the ops reading them, and one all-reduce of the module's output forward and one of its inputs' gradient
backward, on tp's critical path.

Context parallelism (a ``cp`` axis, planner/layout.py): the tokens of every sequence split over it, so everything
the batch divides (activations, compute, the saved bytes) divides by D x cp, the token degree; the parameters stay
whole over it (state sharded over ``dp`` only) and the trained parameters' gradients, partial sums over the
sequence, are all-reduced over ``cp`` in buckets of DDP's cap (an α each), hidden behind the backward as the
data-parallel collectives are. Each attention op gathers its keys and values whole over ``cp`` (the tensors that
reach it before any repeat of grouped heads, as the runtime gathers them: ``repeats_a_split_value`` in
``compiler/propagation/context_rules.py``), twice (the forward, and the backward again, which does not keep them) and reduce-scatters
their gradients: (rows / D) x sequence x width bytes each, on the critical path like tp's.

Sequence parallel (a tp layout's ``sequence_parallel``, Megatron-SP as the runtime's ``sequence_parallel=True``): a
token-wise op (a norm, a pointwise op, a row reduction) may take the ``sequence`` candidate (planner/rules.py), on
1/tp of the tokens (placement ``Q``); the conversions price a row Linear's reduce-scatter into it and the all-gather
out of it before a column Linear, that gather again in the backward (the runtime does not keep the gathered tokens),
and the gradients of the weights it reads (a norm's scale), partial sums over tp, all-reduced over it one each, on
the critical path.

Overlap: data-parallel collectives of the forward (zero2/fsdp gathers) hide behind forward
compute and those of the backward (gradient reduction, fsdp's second gather) behind
backward compute: exposed = max(0, comm - compute) per phase. That is the device's
``overlap`` = 1 (the GPU presets'); a device whose collectives only partly hide (the cpu
preset's 0.3, which ``dpar inspect`` and the bucket plan use) is not yet priced so here. Tensor-parallel collectives
sit on the critical path and are never hidden.

[Note: the root bucket is never hidden]
Under zero2 and fsdp the parameters outside the model's blocks (the embedding, the final norm, the LM head) are one
bucket, as FSDP2 wraps the root module apart from the blocks: gathered before the forward's first op (which reads
the embedding) and reduce-scattered after the backward's last (the embedding's gradient), with no compute left to
hide either behind. So each phase's exposed data-parallel time is at least the root bucket's: exposed = max(root,
comm - compute) per phase, which is root + max(0, the rest - compute) (``CostModel.exposed_dp``, the ILP's rows
alike). Priced as hidden, Llama-3-8B cut to 8 layers under zero2+tp on 8 x 8 (h100 preset) stepped 1.30x faster by
the search than on its graphs, 9.2 ms of the head's bucket exposed each way there. Under ddp gradients are bucketed
by size in the order they are produced, the head's among the first: not priced so.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Iterable

import sympy

from dpar.compiler.costs import ALPHA, BETA, B, N, DeviceSpec, comm_time_expr, moved_bytes_expr, roofline
from dpar.compiler.memory import OPTIMIZER_STATES
from dpar.compiler.options import DDP_BUCKET_CAP_MB
from dpar.core.plan import ALL_GATHER, ALL_TO_ALL
from dpar.planner.layout import Layout
from dpar.planner.opgraph import Op, OpGraph, ParamInfo
from dpar.planner.rules import BACKWARD_CONVERT, FORWARD_CONVERT, Candidate

STATS_BYTES = 4  # fp32 per-row statistics of a vocab-parallel softmax / loss
STATES = OPTIMIZER_STATES["adamw"]  # AdamW's exp_avg and exp_avg_sq, each of the parameter's size and dtype

PSI, D, G, E = sympy.symbols("Psi D g E", nonnegative=True)  # elements per rank after tp, dp degree, trained (0/1), bytes an element

STATE_BYTES = {  # parameter + gradient + optimizer state of Ψ elements of E bytes, at rest
    "replicate": E * PSI + G * (1 + STATES) * E * PSI,
    "zero2": (E * PSI + G * (1 + STATES) * E * PSI) / D,
    "fsdp": (E * PSI + G * (1 + STATES) * E * PSI) / D,
}
# Held gathered from the forward to the backward (D > 1), by (mode, the parameter is the root's): zero2 every
# parameter; fsdp the root's (embedding, head), which its backward does not gather again.
GATHERED_BYTES = {
    ("replicate", False): 0 * PSI, ("replicate", True): 0 * PSI,
    ("zero2", False): E * PSI, ("zero2", True): E * PSI,
    ("fsdp", False): 0 * PSI, ("fsdp", True): E * PSI,
}
# (collective, phase, only for trained parameters, not for the root's) per data-parallel mode.
DP_COLLECTIVES = {
    "replicate": (("all_reduce", "backward", True, False),),
    "zero2": (("all_gather", "forward", False, False), ("reduce_scatter", "backward", True, False)),
    "fsdp": (("all_gather", "forward", False, False), ("all_gather", "backward", False, True),
             ("reduce_scatter", "backward", True, False)),
}
# Bytes read plus written per parameter byte by the data-parallel kernels: (phase, trained only, not the root's).
BUCKET_CAP_BYTES = DDP_BUCKET_CAP_MB * 2**20  # ddp: a gradient smaller than this is copied into a shared bucket
DP_KERNELS = {  # (phase, trained only, not the root's, of the local shard only)
    "replicate": (("backward", True, False, False),),  # gradient / D (and the copy into its bucket: ``bucket_copy_bytes``)
    "zero2": (
        ("forward", False, False, True), ("forward", False, False, False),  # the shard into the all-gather, the parameter out
        ("backward", True, False, False), ("backward", True, False, False),  # the gradient into the reduce-scatter, / D
    ),
    "fsdp": (
        ("forward", False, False, True), ("forward", False, False, False),
        ("backward", False, True, True), ("backward", False, True, False),  # the blocks gathered again
        ("backward", True, False, False), ("backward", True, False, False),
    ),
}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
EXPERT_ID_BYTES = 8  # int64: the local expert id sent with each row

_comm_time = {k: sympy.lambdify((N, B, ALPHA, BETA), comm_time_expr(k), "math") for k in KINDS}
_moved = {k: sympy.lambdify((N, B), moved_bytes_expr(k), "math") for k in KINDS}
_state_bytes = {k: sympy.lambdify((PSI, D, G, E), e, "math") for k, e in STATE_BYTES.items()}
_gathered_bytes = {k: sympy.lambdify((PSI, E), e, "math") for k, e in GATHERED_BYTES.items()}


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One op's share of a step on one rank, times its repeat count."""

    compute_fwd: float
    compute_bwd: float
    tp_comm: float  # critical path
    dp_fwd: float  # bandwidth term of the data-parallel collectives that may hide behind forward compute
    dp_bwd: float  # ... behind backward compute (the α terms are per bucket: CostModel.dp_latency)
    memory: float  # parameter state + gathered parameters + saved activations, bytes
    dp_root_fwd: float = 0.0  # the root bucket's share of dp_fwd, which nothing hides (CostModel.exposed_dp)
    dp_root_bwd: float = 0.0  # ... of dp_bwd


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective in a plan, for the report and the tests that count them."""

    kind: str
    mesh_dim: int
    phase: str  # forward | backward
    bytes: int  # payload of one
    count: int
    where: str


def local_numel(shape: tuple[int, ...], placement: str, tp: int) -> float:
    """Elements per rank of a parameter placed ``R``/``S(d)`` on a tp axis of ``tp`` ranks."""
    return math.prod(shape) / (tp if placement.startswith("S") else 1)


class CostModel:
    """Prices ops, edges and parameters of one graph under one layout on one machine."""

    def __init__(self, graph: OpGraph, layout: Layout, device: DeviceSpec) -> None:
        self.graph, self.layout, self.device = graph, layout, device
        ranks = math.prod(layout.mesh_shape)
        # Processes sharing cores take turns at each ring step.
        self.links = device.sharing_cores(ranks).links(layout.mesh_shape) if ranks > 1 else ()
        self.dp, self.tp, self.ep = layout.dp_degree, layout.tp_degree, layout.ep_degree
        self.tokens = layout.token_degree  # what divides the batch's work: rows over dp, sequences over cp
        self.experts = graph.expert_parameters() if self.ep > 1 else frozenset()  # split over ep: 1/ep per rank
        # Spread over tp by expert where tp divides their count (no ep axis beside a tp one): 1/tp per rank.
        self.tp_experts = graph.expert_parameters(self.tp) if self.tp > 1 else frozenset()
        self.tp_expert_ops = frozenset(p.op for p in graph.params if p.name in self.tp_experts and p.op is not None)
        self.owned: dict[int, list[ParamInfo]] = defaultdict(list)
        for info in graph.params:
            if info.op is not None:
                self.owned[info.op].append(info)
        self.buckets = _bucket_counts(p for p in graph.params if p.name not in self.experts)
        read_root = [p for p in graph.params if p.op is not None and p.bucket == "root" and p.name not in self.experts]
        self.root_buckets = {False: bool(read_root), True: any(p.requires_grad for p in read_root)}  # by trained only
        self.expert_buckets = _bucket_counts(p for p in graph.params if p.name in self.experts)
        self.saved_output = [op.saves_output for op in graph.ops]  # held from the forward to the backward
        self.grad_readers = [0] * len(graph.ops)  # instances of readers handing a gradient back, all instances
        for e in graph.edges:
            if graph.ops[e.src].needs_grad and graph.ops[e.dst].needs_grad and graph.ops[e.dst].kind != "output":
                self.grad_readers[e.src] += e.count
        for e in graph.edges:
            dst = graph.ops[e.dst]
            if e.position < len(dst.saves_inputs) and dst.saves_inputs[e.position]:
                self.saved_output[e.src] = True
        if layout.data_parallel == "replicate":  # ddp fills buckets of its cap in gradient order, not one a block
            self.buckets[True, False] = self.capped_buckets(p for p in graph.params if p.name not in self.experts)
            if self.experts:
                self.expert_buckets[True, False] = self.capped_buckets(p for p in graph.params if p.name in self.experts)
        self._op_costs: dict[tuple[int, Candidate], OpCost] = {}

    def collective(self, kind: str, nbytes: float, axes: tuple[int, ...], alpha: bool = True) -> float:
        """One ring over the ranks of ``axes`` on their slowest link (see the Note); ``alpha=False``: bandwidth term only."""
        n = math.prod(self.layout.mesh_shape[a] for a in axes)
        link_alpha, link_beta = max(self.links[a][0] for a in axes), max(self.links[a][1] for a in axes)
        return _comm_time[kind](n, nbytes, link_alpha if alpha else 0.0, link_beta)

    def moved(self, kind: str, nbytes: float, axes: tuple[int, ...]) -> float:
        return _moved[kind](math.prod(self.layout.mesh_shape[a] for a in axes), nbytes)

    def dp_collectives(self) -> list[tuple[str, str, bool, bool, int]]:
        """(kind, phase, trained only, not the root's, buckets) of this layout's data-parallel collectives per step."""
        if self.dp == 1:
            return []
        return [(k, phase, t, r, self.buckets[t, r]) for k, phase, t, r in DP_COLLECTIVES[self.layout.data_parallel]]

    @property
    def root_apart(self) -> bool:
        """Whether the parameters outside blocks are a bucket of their own, gathered before the first op and reduced
        after the last (zero2 and fsdp: [Note: the root bucket is never hidden]); ddp buckets gradients by size."""
        return self.layout.data_parallel in ("zero2", "fsdp") and self.dp > 1

    def root_latency(self) -> dict[str, float]:
        """The α part of the root bucket's collectives (see ``root_apart``), by phase."""
        seconds = {"forward": 0.0, "backward": 0.0}
        if self.root_apart:
            for kind, phase, trained_only, not_root, _ in self.dp_collectives():
                if not not_root and self.root_buckets[trained_only]:
                    seconds[phase] += self.collective(kind, 0.0, self.layout.dp_axes)
        return seconds

    def exposed_dp(self, costs: Iterable[OpCost], recompute_s: float = 0.0) -> float:
        """The data-parallel seconds of ``costs`` (every op's) that no compute hides: in each phase what its
        collectives take beyond its compute (the backward's recomputation included), and never less than the root
        bucket's (see [Note: the root bucket is never hidden])."""
        costs = list(costs)
        latency, root_latency = self.dp_latency(), self.root_latency()
        dp = {"forward": sum(c.dp_fwd for c in costs), "backward": sum(c.dp_bwd for c in costs)}
        root = {"forward": sum(c.dp_root_fwd for c in costs), "backward": sum(c.dp_root_bwd for c in costs)}
        compute = {"forward": sum(c.compute_fwd for c in costs), "backward": sum(c.compute_bwd for c in costs) + recompute_s}
        return sum(max(root[phase] + root_latency[phase], dp[phase] + latency[phase] - compute[phase])
                   for phase in ("forward", "backward"))

    def dp_latency(self) -> dict[str, float]:
        """The α part of the data-parallel collectives: one per bucket and kind, whatever the candidates (under ep
        the experts' buckets apart, over the ``dp`` axes), and under cp one all-reduce per bucket of gradients."""
        seconds = {"forward": 0.0, "backward": 0.0}
        if self.layout.cp_axis is not None:
            seconds["backward"] += self.context_gradient_buckets() * self.collective("all_reduce", 0.0, (self.layout.cp_axis,))
        for kind, phase, trained_only, not_root, buckets in self.dp_collectives():
            seconds[phase] += buckets * self.collective(kind, 0.0, self.layout.dp_axes)
            if self.experts and self.reduced_over(True):
                experts = self.expert_buckets[trained_only, not_root]
                seconds[phase] += experts * self.collective(kind, 0.0, self.layout.expert_dp_axes)
        return seconds

    def tp_placement(self, info: ParamInfo, placement: str) -> str:
        """The parameter's placement on the tp axis: the op's candidate's, or by expert where tp spreads experts (no
        candidate splits an expert weight)."""
        return "S(0)" if info.name in self.tp_experts else placement

    def param_numel(self, info: ParamInfo, placement: str) -> float:
        """Elements per rank of a parameter placed ``placement`` on the tp axis (an expert's: 1/ep of them, or 1/tp
        where tp spreads them)."""
        return local_numel(info.shape, self.tp_placement(info, placement), self.tp) / (self.ep if info.name in self.experts else 1)

    def tp_split(self, index: int, cand: Candidate) -> int:
        """How many ways op ``index``'s work divides over tp: the candidate's split, or the experts' spread."""
        return self.tp if cand.split or index in self.tp_expert_ops else 1

    def data_degree(self, expert: bool) -> int:
        """The ranks a parameter is reduced (and, under zero2 and fsdp, sharded) over: an expert's ``dp`` ranks, every
        data-parallel rank for the rest."""
        return self.layout.expert_dp_degree if expert else self.dp

    def reduced_over(self, expert: bool) -> tuple[int, ...]:
        """The axes a parameter's data-parallel collectives run over: the experts' over ``dp``, the rest's over every
        data axis; () where that is one rank."""
        axes = self.layout.expert_dp_axes if expert else self.layout.dp_axes
        return axes if self.data_degree(expert) > 1 else ()

    def expert_exchange(self) -> list[tuple[str, str, float, int, str]]:
        """(kind, phase, bytes of one, count, where) of the experts' all-to-alls per step (see the Note); under tp,
        the all-reduces of the spread experts' partial sums, their output forward and their inputs' gradient backward
        (see [Note: experts spread over a tensor-parallel group])."""
        if self.tp_experts:
            return [(kind, phase, info.output_numel * info.itemsize / self.dp, 1, f"{info.module}: {what}")
                    for info in self.graph.experts if info.num_experts % self.tp == 0
                    for kind, phase, what in (("all_reduce", "forward", "its experts' partial sums"),
                                              ("all_reduce", "backward", "its inputs' gradient"))]
        if not self.experts:
            return []
        found = []
        for info in self.graph.experts:
            rows = self.ep * info.rows / self.tokens  # fixed-size buffers: this rank's rows to each of ep ranks
            where = f"{info.module}: rows to their experts and back"
            found += [("all_to_all", "forward", rows * info.width * info.itemsize, 2, where),
                      ("all_to_all", "forward", rows * EXPERT_ID_BYTES, 1, f"{info.module}: the rows' expert ids"),
                      ("all_to_all", "backward", rows * info.width * info.itemsize, 2, where)]
        return found

    def expert_exchange_seconds(self) -> float:
        """The experts' exchange (or tp's reductions of them) in time, on the critical path."""
        axis = self.layout.tp_axis if self.tp_experts else self.layout.ep_axis
        return sum(count * self.collective(kind, nbytes, (axis,)) for kind, _, nbytes, count, _ in self.expert_exchange())

    def context_exchange(self) -> list[tuple[str, str, float, int, str]]:
        """(kind, phase, bytes of one, count, where) of the attention ops' exchange over cp per step, in the
        ``attention_exchange`` this layout takes (see the Note)."""
        return self._exchanges.get(self.attention_exchange, [])

    @functools.cached_property
    def attention_exchange(self) -> str | None:
        """The exchange of every attention op over cp: ``all_to_all`` where all can run by heads and that is faster
        on this device, else ``all_gather``; None without a cp axis. ``parallelize(plan=...)`` applies it."""
        if not self._exchanges:
            return None
        seconds = {name: self._exchange_seconds(listed) for name, listed in self._exchanges.items()}
        return min(seconds, key=lambda name: (seconds[name], name != ALL_GATHER))

    @functools.cached_property
    def _exchanges(self) -> dict[str, list[tuple[str, str, float, int, str]]]:
        """Each exchange the attention ops can take over cp, as ``context_exchange`` lists it (no cp axis: none)."""
        if self.layout.cp_axis is None:
            return {}
        attention = [op for op in self.graph.ops if op.kind == "attention" and len(op.inputs) >= 3]
        found = {ALL_GATHER: [entry for op in attention for entry in self._gathered_keys(op)]}
        if attention and all(self._by_heads(op) for op in attention):
            found[ALL_TO_ALL] = [entry for op in attention for entry in self._exchanged_heads(op)]
        return found

    def _gathered_keys(self, op: Op) -> list[tuple[str, str, float, int, str]]:
        """Keys and values gathered whole, forward and again backward, their gradients reduce-scattered."""
        found = []
        for position, what in ((1, "keys"), (2, "values")):
            src = op.inputs[position]
            numel, itemsize = ((self.graph.ops[src].output_numel, self.graph.ops[src].output_itemsize) if src >= 0
                               else (math.prod(op.input_shapes[position]), op.input_itemsizes[position]))
            # This dp group's rows, every token; beside tp, the heads of this rank (Megatron splits them all).
            nbytes = numel * itemsize / self.dp / self.tp
            where = f"{op.module or op.name}: its {what}"
            found += [("all_gather", "forward", nbytes, op.count, where), ("all_gather", "backward", nbytes, op.count, where)]
            if op.input_grad:
                found.append(("reduce_scatter", "backward", nbytes, op.count, f"{where}' gradient"))
        return found

    def _by_heads(self, op: Op) -> bool:
        """Whether the op's queries, keys and values (as it reads them: grouped heads repeated) hold heads / tp
        heads that cp divides, as ``passes/heads_exchange.py`` needs, and it reads no mask the runtime's choice
        keeps the gathers for."""
        shapes = op.input_shapes[:3]
        if any(len(s) >= 2 and len(shapes[0]) == 4 and s[-2] == shapes[0][2] for s in op.input_shapes[3:]):
            return False  # a mask of a row per query, whole on every rank by heads: the runtime keeps the gathers
        return all(len(s) == 4 and s[1] % self.tp == 0 and (s[1] // self.tp) % self.layout.cp_degree == 0 for s in shapes)

    def _exchanged_heads(self, op: Op) -> list[tuple[str, str, float, int, str]]:
        """Queries, keys and values to heads and the output back (forward), the output's gradient in and the three
        gradients out (backward): one all-to-all of this rank's block each (the log-sum-exp's is not priced)."""
        where = f"{op.module or op.name}"
        local = [math.prod(s) * op.input_itemsizes[i] / self.dp / self.tp / self.layout.cp_degree
                 for i, s in enumerate(op.input_shapes[:3])]
        out = op.output_bytes / self.dp / self.tp / self.layout.cp_degree
        found = [("all_to_all", "forward", nbytes, op.count, f"{where}: its {what} to heads")
                 for nbytes, what in zip(local, ("queries", "keys", "values"))]
        found.append(("all_to_all", "forward", out, op.count, f"{where}: its output back"))
        if op.input_grad:
            found.append(("all_to_all", "backward", out, op.count, f"{where}: its output's gradient to heads"))
            found += [("all_to_all", "backward", nbytes, op.count, f"{where}: the {what}' gradient back")
                      for nbytes, what in zip(local, ("queries", "keys", "values"))]
        return found

    def context_exchange_seconds(self) -> float:
        """The attention exchange over cp in time, on the critical path."""
        return self._exchange_seconds(self.context_exchange())

    def _exchange_seconds(self, listed: list[tuple[str, str, float, int, str]]) -> float:
        return sum(count * self.collective(kind, nbytes, (self.layout.cp_axis,)) for kind, _, nbytes, count, _ in listed)

    def context_gradient_buckets(self) -> int:
        """The all-reduces of the gradients over cp: ``capped_buckets`` of every parameter."""
        return self.capped_buckets(self.graph.params)

    def capped_buckets(self, params: Iterable[ParamInfo]) -> int:
        """The trained ``params``' bytes per rank in buckets of DDP's cap, as the runtime fills them in gradient order
        (ddp's buckets, cp's all-reduces: compiler/passes/gradient_reductions.py); at least one."""
        nbytes = sum(self.param_numel(p, "R") * p.itemsize for p in params if p.requires_grad and p.op is not None)
        return max(1, math.ceil(nbytes / BUCKET_CAP_BYTES))

    def group_copies_bytes(self, info: ParamInfo, nbytes: float) -> float:
        """Bytes the backward's adds move summing the tp group's copies' gradients of a trained parameter (``nbytes``
        this rank's block): under tp each rank of the group runs every rank's rows as a copy of the step ([Note: the
        data contract under tensor parallel] in ``compiler/passes/group_batch.py``), each copy gives a gradient, and
        tp - 1 adds (two read, one written) sum them. None without tp, nor under cp, whose group shares its rows."""
        if self.tp == 1 or self.layout.cp_axis is not None or not info.requires_grad:
            return 0.0
        return (self.tp - 1) * 3 * nbytes

    def context_gradient_seconds(self, nbytes: float) -> float:
        """The bandwidth term of one gradient's all-reduce over cp (its α: ``dp_latency``); 0 without a cp axis."""
        return 0.0 if self.layout.cp_axis is None else self.collective("all_reduce", nbytes, (self.layout.cp_axis,), alpha=False)

    def tp_collective(self, kind: str, nbytes: float) -> float:
        return 0.0 if self.layout.tp_axis is None else self.collective(kind, nbytes, (self.layout.tp_axis,))

    def batch_gather(self) -> tuple[float, float]:
        """(bytes of the gathered batch on one rank, seconds) of the tp group's input all-gather; (0, 0) without tp."""
        if self.tp == 1:
            return 0.0, 0.0
        nbytes = self.graph.batch_bytes / self.dp
        return nbytes, self.tp_collective("all_gather", nbytes)

    def activation_bytes(self, numel: float, batched: bool, placement: str, itemsize: int) -> float:
        """Bytes per rank of an activation: batch split over dp (and its sequences over cp), ``S`` and ``Q`` split
        over tp (``P`` is whole)."""
        return numel * itemsize / (self.tokens if batched else 1) / (self.tp if placement in ("S", "Q") else 1)

    def accumulation_seconds(self, index: int, cand: Candidate) -> float:
        """The backward's adds summing the gradients of op ``index``'s output that its readers hand back (one
        fewer than the readers a gradient comes from), each reading two and writing one of its size."""
        op = self.graph.ops[index]
        readers = self.grad_readers[index] - op.count
        if readers <= 0:
            return 0.0
        nbytes = self.activation_bytes(op.output_numel, op.batched, cand.output, op.output_itemsize)
        return readers * roofline(0, 3 * nbytes, op.dtype, self.device)

    def saved_bytes(self, index: int, cand: Candidate) -> float:
        """Bytes one rank holds from op ``index``'s forward to its backward (one instance): its output if its
        backward or a reader's reads it, and what the op saves of its own (see [Note: what the backward
        saves] in ``capture.py``)."""
        op = self.graph.ops[index]
        held = self.activation_bytes(op.output_numel, op.batched, cand.output, op.output_itemsize) if self.saved_output[index] else 0.0
        own = op.internal_saved / (self.tokens if op.batched else 1) / (self.tp if cand.split else 1)
        return held + own

    def dp_kernel_bytes(self, numel: dict[tuple[bool, bool], float], degree: int) -> dict[str, float]:
        """Bytes the data-parallel kernels read and write per phase for parameters of ``numel`` bytes by
        (trained, root) (see the Note), reduced over ``degree`` ranks."""
        found = {"forward": 0.0, "backward": 0.0}
        if degree == 1:
            return found
        for phase, trained_only, not_root, shard in DP_KERNELS[self.layout.data_parallel]:
            nbytes = sum(b for (trained, root), b in numel.items() if (trained or not trained_only) and not (root and not_root))
            found[phase] += 2 * nbytes / (degree if shard else 1)
        return found

    def bucket_copy_bytes(self, info: ParamInfo, nbytes: float) -> float:
        """ddp: bytes read and written copying a gradient into a bucket it shares (one below the cap; one above it
        is all-reduced alone, in place)."""
        if self.dp == 1 or self.layout.data_parallel != "replicate" or not info.requires_grad or nbytes >= BUCKET_CAP_BYTES:
            return 0.0
        return 2 * nbytes

    def stats_bytes(self, op: Op) -> float:
        """One fp32 value per row of the (vocab-)sharded input, on this rank."""
        rows = math.prod(op.input_shapes[0][:-1])
        return rows * STATS_BYTES / (self.tokens if op.batched else 1)

    def op_cost(self, index: int, cand: Candidate) -> OpCost:
        """The cost of op ``index`` run as ``cand``, priced once (the ILP of every policy and its bounds read it)."""
        key = index, cand
        if key not in self._op_costs:
            self._op_costs[key] = self._priced(index, cand)
        return self._op_costs[key]

    def _priced(self, index: int, cand: Candidate) -> OpCost:
        op = self.graph.ops[index]
        if op.kind == "output":
            return OpCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        moved = sum(
            self.activation_bytes(math.prod(s), b, p, e)
            for s, b, p, e in zip(op.input_shapes, op.input_batched, cand.inputs, op.input_itemsizes)
        )
        moved += sum(local_numel(s, p, self.tp) * e for s, p, e in zip(op.param_shapes, cand.params, op.param_itemsizes))
        moved += self.activation_bytes(op.output_numel, op.batched, cand.output, op.output_itemsize)
        flops = op.flops / (self.tokens if op.batched else 1) / self.tp_split(index, cand)
        fwd = roofline(flops, moved, op.dtype, self.device)
        grads = int(op.input_grad) + int(op.param_grad) if op.params else 2 * int(op.input_grad)
        bwd = fwd * grads
        if op.kernels is not None:  # the op's own ATen kernels (see [Note: an op's kernels] in ``capture.py``)
            fwd, bwd = self.kernel_seconds(op, self.tp_split(index, cand))
        stats = cand.stats * self.tp_collective("all_reduce", self.stats_bytes(op)) if cand.stats else 0.0
        saved = self.saved_bytes(index, cand)
        state = gathered = copies = cp_gradients = 0.0
        for info in self.owned.get(index, []):
            local = self.param_numel(info, cand.params[info.slot])
            expert = info.name in self.experts
            copies += self.bucket_copy_bytes(info, local * info.itemsize) + self.group_copies_bytes(info, local * info.itemsize)
            cp_gradients += self.context_gradient_seconds(local * info.itemsize) if info.requires_grad else 0.0
            state += self.param_state_bytes(local, info.requires_grad, info.itemsize, expert)
            gathered += self.gathered_bytes(local, info.itemsize, info.bucket == "root", expert)
        dp = {"forward": 0.0, "backward": cp_gradients}
        root = {"forward": 0.0, "backward": 0.0}
        kernels = {"forward": 0.0, "backward": 0.0}
        for expert in (False, True):
            nbytes, axes = self.owned_bytes(index, cand, expert), self.reduced_over(expert)
            if not nbytes or not axes:
                continue
            for kind, phase, trained_only, not_root, _ in self.dp_collectives():
                payload = sum(b for (trained, root), b in nbytes.items() if (trained or not trained_only) and not (root and not_root))
                dp[phase] += self.collective(kind, payload, axes, alpha=False)
                if self.root_apart and not not_root:
                    mine = sum(b for (trained, is_root), b in nbytes.items() if is_root and (trained or not trained_only))
                    root[phase] += self.collective(kind, mine, axes, alpha=False)
            for phase, b in self.dp_kernel_bytes(nbytes, self.data_degree(expert)).items():
                kernels[phase] += b / self.device.memory_bandwidth
        kernels["backward"] += copies / self.device.memory_bandwidth + self.accumulation_seconds(index, cand)
        n = op.count
        return OpCost(
            n * fwd + kernels["forward"], n * bwd + kernels["backward"], n * stats + self.sequence_parallel_gradients(index, cand)[1],
            dp["forward"], dp["backward"], n * saved + state + gathered, root["forward"], root["backward"],
        )

    def sequence_parallel_gradients(self, index: int, cand: Candidate) -> tuple[list[float], float]:
        """(bytes of each, seconds) of the all-reduces over tp of the trained weights op ``index`` reads whole while
        sequence parallel splits its tokens (a norm's scale: its gradient is a partial sum over tp)."""
        if cand.name != "sequence":
            return [], 0.0
        sizes = [self.param_numel(info, cand.params[info.slot]) * info.itemsize
                 for info in self.owned.get(index, []) if info.requires_grad]
        return sizes, sum(self.tp_collective("all_reduce", nbytes) for nbytes in sizes)

    def owned_bytes(self, index: int, cand: Candidate, expert: bool = False) -> dict[tuple[bool, bool], float]:
        """Bytes per rank of the parameters op ``index`` owns (the experts', or the others), by (trained, the root's)."""
        nbytes: dict[tuple[bool, bool], float] = defaultdict(float)
        for info in self.owned.get(index, []):
            if (info.name in self.experts) is expert:
                nbytes[info.requires_grad, info.bucket == "root"] += self.param_numel(info, cand.params[info.slot]) * info.itemsize
        return nbytes

    def kernel_seconds(self, op: Op, split: int) -> tuple[float, float]:
        """(forward, backward) seconds of one instance of ``op`` on one rank: each of its kernels at the
        roofline, its FLOPs and the bytes that carry the batch split over dp, everything over ``split`` (tp, where
        the op's work divides over it: ``tp_split``)."""
        batch = self.tokens if op.batched else 1
        seconds = {"forward": 0.0, "backward": 0.0}
        for phase, _, flops, dtype, batched, fixed in op.kernels or ():
            seconds[phase] += roofline(flops / batch / split, (batched / batch + fixed) / split, dtype, self.device)
        return seconds["forward"], seconds["backward"]

    def param_state_bytes(self, numel: float, trained: bool, itemsize: int, expert: bool = False) -> float:
        """Parameter, gradient and optimizer state of ``numel`` elements per rank (after tp and ep), at rest: sharded
        over the data axes (an expert's over ``dp``) under zero2 and fsdp."""
        return _state_bytes[self.layout.data_parallel](numel, self.data_degree(expert), int(trained), itemsize)

    def gathered_bytes(self, numel: float, itemsize: int, root: bool, expert: bool = False) -> float:
        """Bytes of the parameter held gathered from the forward to the backward (zero2's, fsdp's root's)."""
        return _gathered_bytes[self.layout.data_parallel, root](numel, itemsize) if self.reduced_over(expert) else 0.0

    def param_moved_bytes(self, info: ParamInfo, placement: str) -> float:
        """Bytes one rank sends per step for this parameter's data-parallel collectives (and its gradient's all-reduce
        over cp)."""
        payload = self.param_numel(info, placement) * info.itemsize
        over_cp = self.moved("all_reduce", payload, (self.layout.cp_axis,)) if self.layout.cp_axis is not None and info.requires_grad else 0.0
        axes = self.reduced_over(info.name in self.experts)
        if not axes:
            return over_cp
        return over_cp + sum(
            self.moved(kind, payload, axes)
            for kind, _, trained_only, not_root, _ in self.dp_collectives()
            if (info.requires_grad or not trained_only) and not (not_root and info.bucket == "root")
        )

    def convert_forward(self, src: int, cand: Candidate, wanted: str) -> tuple[str | None, float]:
        """Op ``src``'s output turned from ``cand``'s placement into ``wanted`` in the forward, once for all the
        readers that want it so (every instance): the collective and its seconds. The token stream gathered from its
        sequence-parallel shards (``Q``) is gathered again in the backward, which does not keep it
        (compiler/passes/sequence_parallel.py)."""
        kind = FORWARD_CONVERT.get((cand.output, wanted))
        if kind is None:
            return None, 0.0
        op = self.graph.ops[src]
        nbytes = self.activation_bytes(op.output_numel, op.batched, "R", op.output_itemsize)
        again = self.tp_collective(kind, nbytes) if cand.output == "Q" else 0.0
        return kind, op.count * (self.tp_collective(kind, nbytes) + again)

    def backward_convert(self, src: int, arriving: str, wanted: str) -> tuple[str | None, float]:
        """Gradients of op ``src``'s output summed in placement ``arriving``, converted to ``wanted``."""
        kind = BACKWARD_CONVERT.get((arriving, wanted))
        op = self.graph.ops[src]
        if kind is None or not op.needs_grad:
            return None, 0.0
        return kind, op.count * self.tp_collective(kind, self.activation_bytes(op.output_numel, op.batched, "R", op.output_itemsize))


def _bucket_counts(params: Iterable[ParamInfo]) -> dict[tuple[bool, bool], int]:
    """Buckets holding ``params`` (those some op reads), by (trained only, not the root's) as ``DP_COLLECTIVES`` asks."""
    read = [p for p in params if p.op is not None]
    trained = {p.bucket for p in read if p.requires_grad}
    every = trained | {p.bucket for p in read}
    return {(True, False): len(trained), (False, False): len(every), (False, True): len(every - {"root"})}
