"""The records pipeline parallelism's compiler hands its executor: schedules, stages, their graphs.

``compiler/pipeline_parallel/`` builds them (schedules, the split into stages, each stage's F/B/I/W graphs,
their data-parallel variants); ``runtime/pipeline_parallel.py`` runs them; inspection and the planner read
them. Plain frozen data, so the executor needs nothing of the compiler.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch
import torch.fx as fx

from dpar.core.plan import KEEP_ACTIVATIONS, ActivationPolicy


class Op(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACTIVATION = "SA"
    RECV_ACTIVATION = "RA"
    SEND_GRADIENT = "SG"
    RECV_GRADIENT = "RG"

    # Each member is one object: hashed by identity in C, not by its name in Python (Enum's), which was a tenth of
    # replaying Llama-3-405B's pipeline schedules (sets and dicts of actions).
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_OPS


COMPUTE_OPS = frozenset((Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT))


@dataclasses.dataclass(frozen=True)
class Action:
    op: Op
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.op.value}{self.stage}.{self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """Which rank runs what, in what order; ``actions[rank]`` is that rank's whole program.

    ``placement[stage]`` is the rank holding the stage: ``stage % num_ranks`` (looping) for every
    schedule but ``zbv``, whose V puts stages ``r`` and ``2p - 1 - r`` on rank ``r``."""

    name: str
    num_ranks: int
    num_stages: int
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...]

    def stage_rank(self, stage: int) -> int:
        return self.placement[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, holder in enumerate(self.placement) if holder == rank)

    def __str__(self) -> str:
        head = (f"{self.name}: {self.num_ranks} ranks, {self.num_stages} stages, "
                f"{self.micro_batches} micro-batches")
        return "\n".join([head, *(f"rank {r}: " + " ".join(map(str, a)) for r, a in enumerate(self.actions))])


@dataclasses.dataclass(frozen=True)
class ValueSpec:
    """A tensor crossing a stage boundary: what the receiver allocates."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int
    graph: fx.GraphModule
    batch_inputs: tuple[int, ...]  # positions among the user's inputs (target last) this stage reads
    carried_in: tuple[ValueSpec, ...]
    carried_out: tuple[ValueSpec, ...]  # empty on the last stage, whose output is the loss
    parameters: tuple[str, ...]  # names as in model.named_parameters()
    blocks: tuple[str, ...]  # the numbered modules traced into this stage
    flops: float  # per micro-batch, forward


@dataclasses.dataclass(frozen=True)
class StageSplit:
    stages: tuple[Stage, ...]
    block_prefix: str
    shared_parameters: tuple[str, ...]  # read by more than one stage

    def __str__(self) -> str:
        lines = [f"{len(self.stages)} stages over the blocks of {self.block_prefix!r}:"]
        for stage in self.stages:
            blocks = f"{stage.blocks[0]} .. {stage.blocks[-1]}" if stage.blocks else "(no block)"
            sent = sum(math.prod(v.shape) * v.dtype.itemsize for v in stage.carried_out)
            lines.append(
                f"  stage {stage.index}: {blocks}, {len(stage.parameters)} parameters, "
                f"{stage.flops / 1e6:.2f} MFLOP forward per micro-batch, sends {sent} bytes"
            )
        if self.shared_parameters:
            lines.append(f"  shared between stages (gradients summed): {', '.join(self.shared_parameters)}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class StageGraphs:
    """Graphs of one stage. Calling conventions:

    forward(*state, *batch_inputs, *carried_in) -> (*outputs, *saved)
    backward(*state, *saved, *output_grads) -> (*input_grads, *parameter_grads)
    backward_input(*state, *saved, *output_grads) -> (*input_grads, *stash)
    backward_weight(*state, *saved, *output_grads, *stash) -> (*parameter_grads,)

    ``state`` is the stage's parameters (``parameter_names``) then its buffers (``buffer_names``).

    ``input_grads`` are for the carried-in values that take a gradient (``grad_inputs``), output
    gradients for the outputs that take one (``grad_outputs``); a gradient that does not depend on
    anything comes back as ``None``.
    """

    stage: Stage
    parameter_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    grad_inputs: tuple[int, ...]  # positions among carried_in
    grad_outputs: tuple[int, ...]  # positions among outputs
    num_outputs: int
    num_saved: int
    num_stash: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    backward_input: fx.GraphModule
    backward_weight: fx.GraphModule
    activations: ActivationPolicy = KEEP_ACTIVATIONS  # what the cut recomputes, per block (a budget: the rung met)


@dataclasses.dataclass(frozen=True)
class SyncVariant:
    """A backward graph that also all-reduces the stage's accumulated gradients over ``dp``.

    Called as the plain graph plus one accumulated gradient per entry of ``accumulated``
    (positions among the stage's parameters); its parameter gradients are the averaged totals.
    """

    graph: fx.GraphModule
    accumulated: tuple[int, ...]
