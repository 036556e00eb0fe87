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
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.flop_counter import flop_registry

from dpar.compiler.collectives import is_compute
from dpar.core.torch_internals import pytree

N, B, ALPHA, BETA = sympy.symbols("N B alpha beta", positive=True)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One rank's peak throughput and its link to the others."""

    name: str
    flops_fp32: float  # FLOP/s
    flops_16bit: float  # FLOP/s for bf16/fp16 (tensor cores where there are some)
    memory_bandwidth: float  # bytes/s
    alpha: float  # seconds per ring step
    link_bandwidth: float  # bytes/s per rank
    overlap: float = 1.0
    """Share of a collective's time that can run hidden under compute: 1 where communication has
    its own engine (a GPU's copy engines and NIC), 0 where it competes with compute for the cores."""

    @property
    def beta(self) -> float:
        return 1.0 / self.link_bandwidth

    def flops(self, dtype: torch.dtype) -> float:
        return self.flops_16bit if dtype in (torch.bfloat16, torch.float16) else self.flops_fp32


PRESETS: dict[str, DeviceSpec] = {
    # H100 SXM datasheet (dense TF32 / BF16, HBM3), one 400 Gb/s NIC per GPU across nodes.
    "h100": DeviceSpec("h100", 494e12, 989e12, 3.35e12, alpha=5e-6, link_bandwidth=50e9),
    # H200 SXM datasheet: the H100 SXM's compute, 141 GB of HBM3e at 4.8 TB/s; the same NIC.
    "h200": DeviceSpec("h200", 494e12, 989e12, 4.8e12, alpha=5e-6, link_bandwidth=50e9),
    # The 2-core development/CI machine, rounded from benchmarks/validate_simulator.py's
    # calibration (one thread per rank: 512^2 matmul ~95 GFLOP/s, 16 MiB copy ~2.6 GB/s,
    # 2-rank gloo all-reduce over loopback alpha ~175 us, ~0.7 GB/s).
    # overlap 0.3, measured through training steps (benchmarks/bucket_plan.py: 2 ranks, HF Llama 23M,
    # 8x128 tokens a rank): one bucket all-reduced after the backward (~130 ms of gloo) costs 28-45 ms
    # a step more than buckets issued as the backward goes, so about a third of the communication
    # hides. A loop of matmuls hides none of it (gloo's thread and MKL's share the two cores); what
    # hides in a real backward is the time its memory-bound kernels leave a core waiting.
    "cpu": DeviceSpec("cpu", 90e9, 20e9, 2.5e9, alpha=150e-6, link_bandwidth=0.7e9, overlap=0.3),
}


def device_spec(name_or_spec: str | DeviceSpec) -> DeviceSpec:
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if name_or_spec not in PRESETS:
        raise ValueError(f"unknown device {name_or_spec!r}; presets: {sorted(PRESETS)}")
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
    return float(_comm_time_function(kind)(world_size, nbytes, spec.alpha, spec.beta))


def moved_bytes(kind: str, nbytes: int, world_size: int) -> float:
    return float(moved_bytes_expr(kind).subs({N: world_size, B: nbytes}))


def payload_bytes(collective: fx.Node) -> int:
    """B for a collective node: its full buffer, the larger of its operand and its result.

    An all-gather's operand is one rank's shard and a reduce-scatter's result is
    one; the ring formulas above are in the gathered (pre-scatter) size.
    """
    return max(_tensor_bytes(_val(collective.args[0])), _tensor_bytes(_val(collective)))


# ---- compute: a roofline per FX node ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """The roofline of one node: time = max(flops / peak, bytes / bandwidth)."""

    flops: int
    bytes: int
    seconds: float


def _val(arg: Any) -> Any:
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


def node_flops(node: fx.Node) -> int:
    """FLOPs from torch's flop counter formulas; 0 for ops it has none for (elementwise)."""
    packet = getattr(node.target, "_overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    args = pytree.tree_map(_val, node.args)
    kwargs = pytree.tree_map(_val, dict(node.kwargs))
    return int(formula(*args, out_val=_val(node), **kwargs))


def node_cost(node: fx.Node, spec: DeviceSpec) -> NodeCost:
    """Roofline time of a compute node; views (aliases), collectives and waits cost no compute."""
    if not is_compute(node) or getattr(node.target, "is_view", False):
        return NodeCost(0, 0, 0.0)
    flops = node_flops(node)
    out = _val(node)
    nbytes = sum(_tensor_bytes(_val(a)) for a in node.all_input_nodes) + _tensor_bytes(out)
    dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
    seconds = max(flops / spec.flops(dtype), nbytes / spec.memory_bandwidth)
    return NodeCost(flops, nbytes, seconds)


def compute_done(gm: fx.GraphModule, spec: DeviceSpec) -> dict[fx.Node, float]:
    """Seconds of compute (roofline) a graph has run once each node is done, in graph order."""
    done, total = {}, 0.0
    for node in gm.graph.nodes:
        total += node_cost(node, spec).seconds
        done[node] = total
    return done
