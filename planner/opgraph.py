"""The planner's op graph: compute ops, the tensors between them, and which op decides each parameter."""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Op:
    """One compute op (a representative when it stands for ``count`` identical ones in repeated blocks)."""

    name: str
    kind: str  # linear, embedding, norm, attention, softmax, loss, matmul, pointwise, concat, other, output
    module: str
    inputs: tuple[int, ...]  # producing op per activation input; -1: a graph input, buffer or constant
    input_shapes: tuple[tuple[int, ...], ...]
    input_batched: tuple[bool, ...]  # the input carries the batch dimension
    output_shape: tuple[int, ...]
    flops: int  # forward, unsharded
    params: tuple[str, ...]  # parameters read, in argument order (names of this instance)
    param_shapes: tuple[tuple[int, ...], ...]
    param_grad: bool  # some parameter it reads is trained
    input_grad: bool  # some activation input needs a gradient
    batched: bool  # the output carries the batch dimension (split by data parallel)
    count: int = 1
    dtype: torch.dtype = torch.float32  # what it computes in: picks the device's peak (``DeviceSpec.flops``)
    output_itemsize: int = 4  # bytes per element of its output, in the dtype the model runs in
    input_itemsizes: tuple[int, ...] = ()  # per activation input
    param_itemsizes: tuple[int, ...] = ()  # per parameter read
    saves_inputs: tuple[bool, ...] = ()  # per activation input: its backward reads it (see [Note: what the backward saves])
    saves_output: bool = False  # its backward reads its own output
    internal_saved: int = 0  # bytes its backward reads that are neither input nor output (a logsumexp, an rstd), global batch
    kernels: tuple[tuple[str, str, int, torch.dtype, int, int], ...] | None = None
    """The ATen kernels it runs, forward and backward, at the global batch: (phase, ATen op, FLOPs, dtype, bytes carrying the
    batch, other bytes); None: priced by the closed form (see [Note: an op's kernels] in ``capture.py``)."""

    @property
    def output_numel(self) -> int:
        return math.prod(self.output_shape)

    @property
    def output_bytes(self) -> int:
        return self.output_numel * self.output_itemsize

    @property
    def needs_grad(self) -> bool:
        return self.param_grad or self.input_grad


@dataclasses.dataclass(frozen=True)
class Edge:
    """A tensor flowing from op ``src`` into input ``position`` of op ``dst``, ``count`` times."""

    src: int
    dst: int
    position: int
    numel: int
    count: int


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """A parameter, the representative op that decides its placement, and the bucket it is communicated in."""

    name: str
    shape: tuple[int, ...]
    requires_grad: bool
    op: int | None  # representative op index; None: no op reads it
    slot: int | None  # its position in that op's ``params``
    bucket: str | None  # its numbered block (``blocks.3``) or ``root``: one data-parallel collective per bucket
    itemsize: int = 4  # bytes per element of its dtype: what it, its gradient and each optimizer state take


@dataclasses.dataclass(frozen=True)
class ExpertsInfo:
    """A routed experts module (``surgery.expert_parallel.experts_modules``): what an ep axis splits, and what its
    exchange moves. ``rows`` (token, expert) pairs of ``width`` elements reach it in the global batch."""

    module: str
    params: tuple[str, ...]
    num_experts: int
    rows: int
    width: int
    itemsize: int
    output_numel: int = 0  # elements of its output, global batch: what tp reduces where the experts are spread over tp


@dataclasses.dataclass(frozen=True)
class OpGraph:
    ops: tuple[Op, ...]
    edges: tuple[Edge, ...]
    params: tuple[ParamInfo, ...]  # every parameter, in model.named_parameters() order
    shared: tuple[tuple[int, int, int, int], ...]  # (op, slot, other op, other slot) reading one parameter
    batch_size: int
    batch_bytes: int  # the user inputs that carry the batch dimension, global batch: what a tp group gathers
    traced_ops: int  # compute ops before repeated blocks were collapsed
    experts: tuple[ExpertsInfo, ...] = ()  # the routed experts modules, which an ep axis splits
    sequence_length: int = 0  # dim 1 of the first input of two or more dims, where an attention op reads it; 0: none

    @property
    def has_attention(self) -> bool:
        return any(op.kind == "attention" for op in self.ops)

    def expert_parameters(self, divisible_by: int = 1) -> frozenset[str]:
        """The experts' parameters (of the modules whose count ``divisible_by`` divides)."""
        return frozenset(name for info in self.experts if info.num_experts % divisible_by == 0 for name in info.params)
