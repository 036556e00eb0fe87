"""What things cost: device specs, the roofline for compute, the symbolic α-β model for comm.

The compiler plans ddp's gradient buckets from these (``passes/bucket_schedule.py``);
``dpar.inspect`` simulates and reports with the same figures, and ``dpar.planner`` prices pipelines
and layouts with them.

[Note: the α-β ring model]
A collective over N ranks costs ``steps * α + moved_bytes * β``: α is the
latency of one ring step, β the seconds per byte of one rank's link. Ring
all-reduce is a reduce-scatter then an all-gather, 2(N-1) steps moving
2(N-1)/N of the payload per rank; all-gather and reduce-scatter take N-1 steps
moving (N-1)/N of the full (gathered) size. Broadcast is a binomial tree:
ceil(log2 N) rounds, each sending the whole payload. At N = 1 every cost is 0.
The formulas are sympy expressions in N, B (payload bytes), α and β so that a
report can print them and how they grow with N.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import flop_registry

from dpar.compiler.collectives import is_compute, runs_an_op
from dpar.core.errors import OptionsError
from dpar.core.torch_internals import optimization_hint, pytree

N, B, ALPHA, BETA = sympy.symbols("N B alpha beta", positive=True)


GPUS_PER_NODE = 8
"""A mesh dimension of at most this many ranks stays inside one node (NVLink) on the GPU presets."""


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """The one device description: one rank's peak throughput per dtype, its memory bandwidth, and
    its links, as the backend's bucket and prefetch plans, ``dpar inspect``, the planner and the
    pipeline planner all price it.

    [Note: the device's links]
    ``alpha`` and ``link_bandwidth`` are the link between nodes (a GPU's NIC); ``intra_alpha`` and
    ``intra_link_bandwidth`` the link inside one node of ``node_size`` ranks (NVLink), the same as
    the inter-node link where not given. ``links(mesh_shape)`` gives one (α, β) per mesh dimension:
    the last dimension is node-local when it fits in a node, the others cross nodes, which is what
    lets the planner put data parallel on a slow dimension and tensor parallel on a fast one; the whole
    world of a 1-D strategy (``world_link``) is the one dimension of a mesh (N,), node-local up to a node.
    ``mesh_links`` (one (α, β) per dimension) replaces that rule for a machine given by hand.
    A collective among given ranks (``link_among``: what ``dpar inspect`` prices a mesh dimension's group
    with) runs on the node-local link when they all lie in one node of ``node_size`` consecutive ranks,
    else on the inter-node link, the slowest hop of a ring across nodes.
    """

    name: str
    flops_fp32: float  # FLOP/s of fp32 math (and of fp32 matmuls where there is no TF32)
    flops_16bit: float  # FLOP/s for bf16/fp16 (tensor cores where there are some)
    memory_bandwidth: float  # bytes/s
    alpha: float  # seconds per ring step between nodes
    link_bandwidth: float  # bytes/s per rank between nodes
    overlap: float = 1.0
    """Share of a collective's time that can run hidden under compute: 1 where communication has
    its own engine (a GPU's copy engines and NIC), 0 where it competes with compute for the cores."""
    flops_tf32: float | None = None
    """FLOP/s of fp32 matmuls run as TF32 (tensor cores); None: no TF32, ``flops_fp32``. dpar prices an
    fp32 model's matmuls at TF32, as ``torch.set_float32_matmul_precision("high")`` runs them on GPUs."""
    node_size: int = GPUS_PER_NODE
    intra_alpha: float | None = None  # seconds per ring step inside a node; None: ``alpha``
    intra_link_bandwidth: float | None = None  # bytes/s per rank inside a node; None: ``link_bandwidth``
    mesh_links: tuple[tuple[float, float], ...] | None = None
    """(α seconds, β seconds/byte) per mesh dimension, given by hand: replaces the node rule."""
    memory_bytes: float | None = None
    """One rank's device memory: the planner's budget when the user gives none. None (a CPU, whose ranks
    share the machine's memory): no budget unless given."""
    staged_collectives: bool = False
    """The collective library stages all-gathers and reduce-scatters through buffers of their own, as gloo
    does on a CPU ([Note: gloo stages its gathers and reductions] in ``compiler/memory.py``): the memory model
    counts them. NCCL works in place."""
    collective_host_seconds: float = 0.0
    """Seconds the calling thread spends on one collective (the functional op, the library's issue, the wait's
    bookkeeping): see [Note: host work the graphs' kernels do not show]."""
    tensor_host_seconds: tuple[float, float] = (0.0, 0.0)
    """Seconds a step spends around the compiled graphs per parameter or buffer: (a plain tensor, a DTensor)."""
    cores: int | None = None
    """Cores the ranks of one machine share, where they are processes on a CPU (None: each rank has its own
    device): past one rank a core, each ring step waits for the other ranks' turns (``step_latency_scale``)."""
    kernel_times: KernelTimes | None = None
    """Seconds measured for the kernels of given graphs (``dpar.compiler.kernel_profile.time_kernels``):
    ``node_cost`` prices a node found here at its measured time, every other by the roofline."""

    @property
    def beta(self) -> float:
        return 1.0 / self.link_bandwidth

    def flops(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s of a matmul in ``dtype``: bf16/fp16 at the 16-bit peak, fp32 at TF32 where there is one."""
        if dtype in (torch.bfloat16, torch.float16):
            return self.flops_16bit
        return self.flops_tf32 or self.flops_fp32

    @property
    def inter_link(self) -> tuple[float, float]:
        """(α, β) between nodes."""
        return (self.alpha, self.beta)

    @property
    def intra_link(self) -> tuple[float, float]:
        """(α, β) inside one node."""
        return (self.alpha if self.intra_alpha is None else self.intra_alpha,
                1.0 / (self.intra_link_bandwidth or self.link_bandwidth))

    def link_among(self, ranks: Sequence[int]) -> tuple[float, float]:
        """(α, β) of a ring among ``ranks`` (see [Note: the device's links]); a device given by hand
        (``mesh_links``) names no node, so its inter-node link."""
        if self.mesh_links is None and len({r // self.node_size for r in ranks}) == 1:
            return self.intra_link
        return self.inter_link

    def world_link(self) -> tuple[sympy.Expr, sympy.Expr]:
        """(α, β) of a ring over the whole world of N ranks, as expressions in N: node-local while the N
        consecutive ranks fit in one node (see [Note: the device's links]), the inter-node link past it;
        a device given by hand (``mesh_links``) names no node, so its inter-node link."""
        if self.mesh_links is not None or self.intra_link == self.inter_link:
            return self.inter_link
        return tuple(sympy.Piecewise((intra, N <= self.node_size), (inter, True))  # type: ignore[return-value]
                     for intra, inter in zip(self.intra_link, self.inter_link))

    def step_latency_scale(self, ranks: int) -> float:
        """How much longer one ring step takes with ``ranks`` processes on ``cores`` cores (1: a core each).

        Measured on the 2-core machine (2026-11-29, functional collectives of 256 KiB-4 MiB, gloo): the
        all-reduce's per-step time at 4 and 8 ranks was 1.3x and 2.5x that at 2; half a step more per extra
        rank a core (1.5x, 2.5x) follows it.
        """
        if self.cores is None or ranks <= self.cores:
            return 1.0
        return 1.0 + 0.5 * (ranks / self.cores - 1.0)

    def sharing_cores(self, ranks: int) -> DeviceSpec:
        """This device with ``ranks`` processes on its cores: every link's α times ``step_latency_scale``, as the
        planner prices a world's collectives (the placement search and the pipeline search alike)."""
        scale = self.step_latency_scale(ranks)
        if scale == 1.0:
            return self
        return dataclasses.replace(
            self, alpha=self.alpha * scale, cores=None,
            intra_alpha=None if self.intra_alpha is None else self.intra_alpha * scale,
            mesh_links=None if self.mesh_links is None else tuple((a * scale, b) for a, b in self.mesh_links),
        )

    def links(self, mesh_shape: tuple[int, ...]) -> tuple[tuple[float, float], ...]:
        """One (α, β) per mesh dimension (see [Note: the device's links])."""
        if self.mesh_links is not None:
            if len(self.mesh_links) != len(mesh_shape):
                raise OptionsError(
                    f"device {self.name!r} has links for {len(self.mesh_links)} mesh dimension(s) but mesh_shape "
                    f"{mesh_shape} has {len(mesh_shape)}; give one (alpha, beta) per mesh dimension, or use a preset"
                )
            return self.mesh_links
        found = [self.inter_link] * len(mesh_shape)
        if mesh_shape and mesh_shape[-1] <= self.node_size:
            found[-1] = self.intra_link
        return tuple(found)


# H100 SXM datasheet: dense FP32 67, TF32 494, BF16 989 TFLOP/s, HBM3 3.35 TB/s; NVLink 4 450 GB/s per
# direction inside a node of 8, one 400 Gb/s (50 GB/s) NIC per GPU across nodes. α: NCCL's per-step
# latency, roughly (1 us over NVLink, 5 us across nodes).
_H100 = dict(flops_fp32=67e12, flops_tf32=494e12, flops_16bit=989e12, alpha=5e-6, link_bandwidth=50e9,
             intra_alpha=1e-6, intra_link_bandwidth=450e9)

PRESETS: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", memory_bandwidth=3.35e12, memory_bytes=80e9, **_H100),
    # H200 SXM datasheet: the H100 SXM's compute and links, 141 GB of HBM3e at 4.8 TB/s.
    "h200": DeviceSpec("h200", memory_bandwidth=4.8e12, memory_bytes=141e9, **_H100),
    # One core of the 2-core development/CI machine (an AMD EPYC, 32 MiB L3), one thread per rank, rounded
    # from benchmarks/measured_vs_modelled.py's calibration (timed in the thread's CPU time, which the
    # neighbours' load does not inflate): fp32 512^2 matmul 101-111 GFLOP/s (any shape of the benchmark's
    # Llamas 105-117), bf16 ~480 GFLOP/s; a 16 MiB copy 39-50 GB/s (L3: what activation-sized tensors
    # of these models get; past L3 it falls to ~6 GB/s); 2-rank gloo all-reduce over loopback alpha
    # 80-170 us, 1.5-2.7 GB/s (wall time, noisy on a shared machine).
    # overlap 0.3, measured through training steps (benchmarks/bucket_plan.py: 2 ranks, HF Llama 23M,
    # 8x128 tokens a rank): one bucket all-reduced after the backward (~130 ms of gloo) costs 28-45 ms
    # a step more than buckets issued as the backward goes, so about a third of the communication
    # hides. A loop of matmuls hides none of it (gloo's thread and MKL's share the two cores); what
    # hides in a real backward is the time its memory-bound kernels leave a core waiting.
    # One machine: every mesh dimension is the same loopback link.
    # Host work (see [Note: host work the graphs' kernels do not show]), thread CPU time on 2 gloo ranks: 20
    # all-gathers, reduce-scatters or all-reduces of 1 KiB issued back to back and waited for once done, 31-56 us
    # each; around the graphs, a stack of 128 Linears (256 parameters) took 9 us a parameter under ddp and
    # 62-66 under zero2 and fsdp.
    "cpu": DeviceSpec("cpu", 100e9, 450e9, 40e9, alpha=150e-6, link_bandwidth=1.5e9, overlap=0.3, staged_collectives=True,
                      collective_host_seconds=45e-6, tensor_host_seconds=(9e-6, 60e-6), cores=2),
}


def tensor_host_time(tensors: Iterable[torch.Tensor], spec: DeviceSpec) -> float:
    """Host seconds a step spends around the compiled graphs for ``tensors`` (parameters and buffers).

    [Note: host work the graphs' kernels do not show]
    A step's thread does more than its graphs' kernels. Each collective costs the calling thread its
    functional op, the library's issue and the wait's bookkeeping; around the graphs, Dynamo's guards,
    AOTAutograd's wrappers and autograd's accumulation into ``.grad`` cost each parameter and buffer a
    little, and a DTensor several times more (its wrapping and dispatch run in Python). Where the host is
    the compute device (a CPU), all of it is compute time: ConvBN's step under fsdp on 2 gloo ranks spent
    ~5 ms around its graphs and ~2 ms on its 28 collectives' host work besides its ~19 ms of kernels, and
    priced by its kernels alone came out at 0.63-0.71 of it. The device carries what they cost
    (``collective_host_seconds``, ``tensor_host_seconds``); the timeline runs a collective's host work on
    the compute stream before issuing it, and ``dpar.explain`` the work around the graphs before the first
    graph. A GPU's host thread runs ahead of its streams, so the GPU presets say 0: what it costs there
    shows only in a step too small to cover it. Not counted: the calling thread's copies of large payloads
    (the functional all-reduce's out-of-place copy, gloo's staging), whose cost on this host swung from
    nothing to 0.6 ms a MiB with the allocator's page faults."""
    plain, wrapped = spec.tensor_host_seconds
    return sum(wrapped if isinstance(t, DTensor) else plain for t in tensors)


def device_spec(name_or_spec: str | DeviceSpec) -> DeviceSpec:
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if name_or_spec not in PRESETS:
        raise OptionsError(f"unknown device {name_or_spec!r}; presets: {sorted(PRESETS)}, or a DeviceSpec")
    return PRESETS[name_or_spec]


_ASSUMED_DEVICE: contextvars.ContextVar[DeviceSpec | None] = contextvars.ContextVar("dpar_assumed_device", default=None)


@contextlib.contextmanager
def assumed_device(spec: str | DeviceSpec) -> Iterator[None]:
    """Plan for ``spec`` instead of the parameters' device: ``dpar.explain`` simulating an H100 on a CPU."""
    token = _ASSUMED_DEVICE.set(device_spec(spec))
    try:
        yield
    finally:
        _ASSUMED_DEVICE.reset(token)


def spec_of_device(device: torch.device) -> DeviceSpec:
    """The preset for where the parameters live (or the one ``assumed_device`` set): the CPU's for a
    CPU, by product name for a GPU (an unknown one is costed as an H100)."""
    assumed = _ASSUMED_DEVICE.get()
    if assumed is not None:
        return assumed
    if device.type != "cuda":
        return PRESETS["cpu"]
    name = torch.cuda.get_device_name(device).upper()
    return PRESETS["h200"] if "H200" in name else PRESETS["h100"]


def spec_of_tensors(tensors: Iterable[torch.Tensor | None]) -> DeviceSpec:
    """``spec_of_device`` for the first of ``tensors`` (the parameters); the CPU's when there is none."""
    return spec_of_device(next((t.device for t in tensors if t is not None), torch.device("cpu")))


def _ceil_log2(n: sympy.Expr) -> sympy.Expr:
    return sympy.ceiling(sympy.log(n, 2))


# (latency steps, bytes moved per rank as a fraction of B) per collective kind.
COMM_TERMS: dict[str, tuple[sympy.Expr, sympy.Expr]] = {
    "all_reduce": (2 * (N - 1), 2 * (N - 1) / N),
    "all_gather": (N - 1, (N - 1) / N),
    "reduce_scatter": (N - 1, (N - 1) / N),
    "all_to_all": (N - 1, (N - 1) / N),  # pairwise exchange: every rank keeps 1/N of its buffer
    "broadcast": (_ceil_log2(N), _ceil_log2(N)),
}


def comm_time_expr(kind: str) -> sympy.Expr:
    """Seconds for one collective of ``B`` payload bytes over ``N`` ranks, in α and β."""
    steps, moved = COMM_TERMS[kind]
    return steps * ALPHA + moved * B * BETA


def moved_bytes_expr(kind: str) -> sympy.Expr:
    """Bytes one rank sends for one collective of ``B`` payload bytes."""
    return COMM_TERMS[kind][1] * B


@functools.cache
def _comm_time_function(kind: str) -> Callable[[int, int, float, float], float]:
    """``comm_time_expr(kind)`` as plain Python: the bucket plan evaluates it for every candidate bucket."""
    return sympy.lambdify((N, B, ALPHA, BETA), comm_time_expr(kind), modules="math")


def comm_time(kind: str, nbytes: int, world_size: int, spec: DeviceSpec) -> float:
    """One collective over the world on the inter-node link (see [Note: the device's links])."""
    return link_time(kind, nbytes, world_size, spec.inter_link)


def link_time(kind: str, nbytes: float, world_size: int, link: tuple[float, float]) -> float:
    """One collective on a given (α, β) link, e.g. one of ``DeviceSpec.links``."""
    return float(_comm_time_function(kind)(world_size, nbytes, *link))


def moved_bytes(kind: str, nbytes: int, world_size: int) -> float:
    return float(moved_bytes_expr(kind).subs({N: world_size, B: nbytes}))


def payload_bytes(collective: fx.Node) -> int:
    """B for a collective node: its full buffer, the larger of its operand and its result.

    An all-gather's operand is one rank's shard and a reduce-scatter's result is
    one; the ring formulas above are in the gathered (pre-scatter) size.
    """
    return max(_tensor_bytes(example_value(collective.args[0])), _tensor_bytes(example_value(collective)))


# ---- compute: a roofline per FX node, or its measured time ------------------------------


KernelKey = tuple[str, str]
"""An ATen call as it runs: its op and the shapes, strides and dtypes of its tensors and its other arguments."""


def kernel_key(node: fx.Node) -> KernelKey:
    """What a kernel's time depends on, read from the node's example values (hinted where symbolic)."""
    def signature(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), tuple(value.stride()), str(value.dtype))
        if isinstance(value, torch.device):
            return "device"  # the timing device replaces it: a meta trace and a real one give one key
        return value

    args = pytree.tree_map(lambda a: signature(example_value(a) if isinstance(a, fx.Node) else a), (node.args, dict(node.kwargs)))
    return (str(node.target), repr(args))


@dataclasses.dataclass(frozen=True)
class KernelTimes:
    """[Note: profile-guided kernel costs]
    The roofline prices a kernel at the device's peak rate or bandwidth. Where kernels run far from both,
    it is wrong by their distance: a CPU's small convolutions (oneDNN spends 50-300 us a call before any
    arithmetic; a 3-channel 7x7 stem's weight gradient runs at ~10 GFLOP/s against the matmul's ~110:
    a ResNet's step priced at a quarter of what it takes or less), fp32 attention on a GPU's CUDA cores (priced at
    TF32's tensor-core peak: half the time measured). So the device description can carry measured
    times, as DeepCompile's profile-guided passes and autoparallel's benchmarked op costs do: each
    distinct kernel of the graphs (op, shapes, strides, dtypes, arguments: ``kernel_key``) run on this
    machine's device on inputs of its shapes, the median of a few runs after warm-ups; views too, which
    the roofline prices at nothing but which cost a CPU's dispatcher 3-9 us each (fsdp's gathered buffers
    are split into parameters by hundreds of them: ConvBN's step under fsdp runs ~6 ms longer than
    under ddp on the same kernels). The graphs are
    priced as before, a node at its measured time where timed and by the roofline where not (a kernel
    past the size limit, one that could not run on made-up inputs), and every consumer of ``node_cost``
    (``dpar.explain``'s timeline, ``dpar.plan``'s pricing on graphs, the pipeline's stage costs) sees the
    same figures. Only this machine's device can be timed: the times are its own, so a report for another
    device would mix two machines (``dpar.explain`` refuses that).
    """

    device: str  # what ran them, e.g. "cpu" or the GPU's product name
    seconds: tuple[tuple[KernelKey, float], ...]  # one entry per kernel timed
    untimed: int = 0  # distinct kernels left to the roofline (too large, or they did not run)

    @functools.cached_property
    def by_key(self) -> dict[KernelKey, float]:
        return dict(self.seconds)

    def describe(self) -> str:
        return f"{len(self.seconds)} kernels timed on {self.device}" + (f", {self.untimed} by the roofline" if self.untimed else "")




@dataclasses.dataclass(frozen=True)
class NodeCost:
    """The roofline of one node: time = max(flops / peak, bytes / bandwidth)."""

    flops: int
    bytes: int
    seconds: float


def example_value(arg: Any) -> Any:
    """A node's example value with every symbolic size replaced by its hint: costing a graph compiled
    for dynamic shapes must not guard on its sizes (``int()`` of one would, and specialise the graph
    to this batch, recompiling it for every other)."""
    return _hinted(arg.meta.get("val") if isinstance(arg, fx.Node) else arg)


def _hinted(value: Any) -> Any:
    if isinstance(value, torch.SymInt):
        return optimization_hint(value, fallback=1)
    if isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride())):
        return torch.empty_strided(
            [_hinted(d) for d in value.shape], [_hinted(d) for d in value.stride()], dtype=value.dtype, device="meta"
        )
    if isinstance(value, (list, tuple)):
        return type(value)(_hinted(v) for v in value)
    return value


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel()) * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


_aten = torch.ops.aten
_ATTENTION = {_aten.scaled_dot_product_attention, _aten._scaled_dot_product_flash_attention_for_cpu}
_ATTENTION_BACKWARD = {_aten._scaled_dot_product_flash_attention_for_cpu_backward}  # args: grad_out, q, k, v, ...


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Scaled-dot-product attention as the one fused kernel it runs as on a GPU (flash / memory-efficient) and
    on the CPU (``_scaled_dot_product_flash_attention_for_cpu``), on any device meta included: it saves Q, K,
    V, its output and a logsumexp per row, never the B·H·S² score matrix the math path writes. What
    ``dpar inspect`` traces a meta model's attention as and what the planner asks autograd about (see
    [Note: attention on meta] below)."""
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def attention_fused(gm: fx.GraphModule) -> fx.GraphModule:
    """[Note: attention on meta]
    On a meta tensor ``F.scaled_dot_product_attention`` finds no fused kernel (its choice of backend is
    made per device, and meta has none) and falls to its math path: Q·Kᵀ written as an fp32 score matrix
    (B·H·S² elements), a softmax, P·V, and the backward saving the scores. No device dpar prices runs
    that: CUDA (flash / memory-efficient) and the CPU (``_scaled_dot_product_flash_attention_for_cpu``) run
    one kernel that saves the output and a logsumexp per row (B·H·S) and recomputes the scores in its
    backward. On Llama-3-8B (one row of 2048 tokens) the math path keeps 4·32·2048² bytes = 537 MB of
    scores a layer, and its step on 64 H100s (fsdp) was priced 398.1 ms of compute, 337.5 ms with the
    fused kernel. So a model traced on meta has each SDPA call of its Dynamo graph replaced by that
    kernel (``compiler.costs.flash_attention``: one forward node and one backward node, their FLOPs by
    ``compiler.costs.node_flops``), which is what the planner asks autograd about too. A call asking for GQA
    (``enable_gqa``) or a dropout is left as it is (the CPU kernel does not take the first; the second
    draws randoms).
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
            continue
        gqa = node.kwargs.get("enable_gqa") or (len(node.args) > 7 and node.args[7])
        if gqa or (len(node.args) > 4 and node.args[4]) or node.kwargs.get("dropout_p"):
            continue
        node.target = flash_attention
        changed = True
    if changed:
        gm.recompile()
    return gm


def node_flops(node: fx.Node) -> int:
    """Forward FLOPs of one ATen node: the one count the inspector, the planner and the pipeline split use.

    torch's flop counter formulas (mm, addmm, bmm, baddbmm, convolution, the fused attention
    kernels), and the composite ops a non-decomposed (exported) graph keeps whole: ``aten.linear``
    (2·M·K·N; the bias's M·N is not counted, as addmm's formula does not), ``aten.matmul`` and the experts'
    grouped matmuls (2·out·K) and scaled-dot-product attention (Q·Kᵀ and P·V: 2·B·H·S_q·S_k·(D_qk + D_v), torch's
    formula; no causal halving; its fused backward twice that: dQ, dK, dV and dP, torch's count, which
    is the planner's "one forward per gradient" for an op of two inputs). 0 for every other op (elementwise, norms, softmax, embedding, loss):
    their time is the bytes they move (``node_cost``'s roofline), not their arithmetic.
    """
    if node.op != "call_function":
        return 0
    packet = getattr(node.target, "_overloadpacket", None)
    out = example_value(node)
    if packet is _aten.linear:
        return 2 * int(_tensor_numel(out)) * int(example_value(node.args[1]).shape[-1])
    if packet is _aten.matmul:
        return 2 * int(_tensor_numel(out)) * int(example_value(node.args[0]).shape[-1])
    if grouped_mm(packet) == "forward":
        return 2 * int(_tensor_numel(out)) * int(example_value(node.args[0]).shape[-1]) // _routed_share(node)
    if grouped_mm(packet) == "backward":  # (input, weight, offs, grad_output): the input's and the weight's gradients
        grad_output = example_value(node.args[3])
        return 4 * int(grad_output.numel()) * int(example_value(node.args[0]).shape[-1]) // _routed_share(node)
    if packet in _ATTENTION or packet in _ATTENTION_BACKWARD:
        q, k, v = (example_value(a) for a in node.args[int(packet in _ATTENTION_BACKWARD):][:3])
        forward = 2 * (int(q.numel()) // int(q.shape[-1])) * int(k.shape[-2]) * (int(q.shape[-1]) + int(v.shape[-1]))
        return forward * (2 if packet in _ATTENTION_BACKWARD else 1)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    args = pytree.tree_map(example_value, node.args)
    kwargs = pytree.tree_map(example_value, dict(node.kwargs))
    return int(formula(*args, out_val=out, **kwargs))


# Routed experts' grouped matmuls, rows (M, K) by per-expert weights into (M, N): torch's, and Hugging Face's own
# ops where torch's kernel is not available (CPU, meta). torch's flop counter has no formula for them.
_GROUPED_MM = {"_grouped_mm": "forward", "grouped_mm_fallback": "forward", "grouped_mm_fallback_backward": "backward"}


def grouped_mm(packet: Any) -> str | None:
    """``forward`` or ``backward`` for a grouped matmul's op, None for any other."""
    return None if packet is None else _GROUPED_MM.get(str(packet).rsplit(".", 1)[-1])


ROUTED_SHARE = "dpar_routed_share"
"""``node.meta`` key of a grouped matmul under expert parallel: how many times the rows it is handed hold the rows
routed to it on average (ep: the fixed-size buffers of [Note: routed tokens in fixed-size buffers], whose empty
slots the matmul's offsets skip). Set by compiler/passes/expert_rows.py; 1 where absent."""


def _routed_share(node: fx.Node) -> int:
    return int(node.meta.get(ROUTED_SHARE, 1))


def _tensor_numel(value: Any) -> int:
    return int(value.numel()) if isinstance(value, torch.Tensor) else int(value[0].numel())


def roofline(flops: float, nbytes: float, dtype: torch.dtype, spec: DeviceSpec) -> float:
    """Seconds of one kernel: its FLOPs at ``dtype``'s peak or its bytes at the memory bandwidth, the larger."""
    return max(flops / spec.flops(dtype), nbytes / spec.memory_bandwidth)


def is_kernel(node: fx.Node) -> bool:
    """A node that runs a kernel, priced by ``node_cost``: not a view (alias), a collective or a wait."""
    return is_compute(node) and not getattr(node.target, "is_view", False)


def kernel_bytes(node: fx.Node) -> int:
    """Bytes a kernel reads and writes: its input tensors and its output, once each."""
    return sum(_tensor_bytes(example_value(a)) for a in node.all_input_nodes) + _tensor_bytes(example_value(node))


def node_cost(node: fx.Node, spec: DeviceSpec) -> NodeCost:
    """Time of a compute node: measured where ``spec`` carries it (see [Note: profile-guided kernel costs]:
    a view's dispatch included), else the roofline, by which views (aliases) cost nothing; collectives and
    waits cost no compute."""
    if not runs_an_op(node):
        return NodeCost(0, 0, 0.0)
    measured = spec.kernel_times.by_key.get(kernel_key(node)) if spec.kernel_times is not None else None
    if not is_kernel(node):
        return NodeCost(0, 0, measured or 0.0)
    flops = node_flops(node)
    out = example_value(node)
    nbytes = kernel_bytes(node)
    if measured is not None:
        return NodeCost(flops, nbytes, measured)
    dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
    return NodeCost(flops, nbytes, roofline(flops, nbytes, dtype, spec))


def compute_done(gm: fx.GraphModule, spec: DeviceSpec) -> dict[fx.Node, float]:
    """Seconds of compute (roofline) a graph has run once each node is done, in graph order."""
    done, total = {}, 0.0
    for node in gm.graph.nodes:
        total += node_cost(node, spec).seconds
        done[node] = total
    return done
