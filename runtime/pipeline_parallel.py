"""Running a pipeline schedule: each rank walks its list of actions over its stages' graphs.

[Note: the pipeline's data contract]
Every rank is fed its own slice of the global batch, as under DDP. A pipeline group of ``p``
ranks trains on the ``p`` slices of its members as one batch: the step all-gathers them over
the group (every rank gets the whole batch; a stage reads the inputs it needs, the first stage
the tokens, the last the targets), cuts that batch into ``m`` equal micro-batches, and weights
each micro-batch's loss by ``1/m``. With a mean loss that is the mean over the group's rows, so
the gradients are those of one process on those rows; over a ``("dp", "pp")`` mesh, the
gradients are then averaged over ``dp``, which is torch DDP's average of equal slices. Under a mesh
with a ``tp`` dimension the ``t`` pipelines of one ``dp`` index are one tensor-parallel pipeline:
the step gathers their ``p * t`` slices over ``pp`` and then ``tp``, so every rank of a tensor-parallel
group runs the same micro-batches (each rank's slice still counts once, as under DDP).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from dpar.core.pipeline_program import Action, Op, PipelineSchedule, StageGraphs, SyncVariant
from dpar.core.model_state import local_part
from dpar.core.torch_internals import pytree

_TAG_FIELDS = (2, 256, 4096, 64)  # direction, stage, micro-batch, tensor index: a unique p2p tag


def _tag(gradient: bool, stage: int, micro_batch: int, index: int) -> int:
    return ((int(gradient) * _TAG_FIELDS[1] + stage) * _TAG_FIELDS[2] + micro_batch) * _TAG_FIELDS[3] + index


@dataclasses.dataclass(frozen=True)
class PipelineGroups:
    """The ranks a pipeline step talks to; ``None`` groups mean one process."""

    pp: dist.ProcessGroup | None
    pp_ranks: tuple[int, ...]  # global ranks, by pipeline position
    pp_rank: int
    dp: dist.ProcessGroup | None
    dp_size: int
    dp_rank: int = 0
    tp: dist.ProcessGroup | None = None  # [Note: tensor parallel inside a pipeline stage]
    tp_size: int = 1
    tp_rank: int = 0


@dataclasses.dataclass(frozen=True)
class ActionTime:
    action: Action
    start: float
    end: float


class PipelineExecutor:
    """One step of the schedule on this rank: forward and backward of the whole batch."""

    def __init__(
        self, schedule: PipelineSchedule, graphs: dict[int, StageGraphs], model: nn.Module,
        groups: PipelineGroups, shared: dict[str, tuple[torch.Size, torch.dtype]],
        sync: dict[int, SyncVariant] | None = None, gather: dict[int, fx.GraphModule] | None = None,
        chunks: dict[str, int] | None = None,
        lower: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]] | None = None,
    ) -> None:
        self.schedule = schedule
        # [Note: compiled pipeline stages]: each graph lowered at its first run (after a meta model's retarget).
        self.lower = lower
        self.lowered: dict[fx.GraphModule, Callable[..., Any]] = {}
        self.graphs = graphs
        self.model = model
        self.state: dict[str, torch.Tensor] = {}  # parameters and buffers by name, looked up at each step
        self.parameters: dict[str, nn.Parameter] = {}
        self.refresh_state()
        # dp_strategy="fsdp": each sharded parameter's padded shard length (see ShardLayout).
        self.chunks = chunks or {}
        self.groups = groups
        # Parameters read on several stages: the shape and dtype of the gradient each rank sums (its shard under fsdp).
        self.shared = shared
        # [Note: data parallel across pipelines]: each stage's last B or W runs its sync variant.
        self.sync = sync or {}
        own = schedule.actions[groups.pp_rank]
        self.last_backward = {
            s: [a for a in own if a.stage == s and a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT)][-1] for s in self.sync
        }
        # [Note: sharded data parallel across pipelines]: a stage's first F gathers its parameters.
        self.gather = gather or {}
        self.first_forward = {s: next(a for a in own if a.stage == s and a.op is Op.FORWARD) for s in self.gather}
        self.gathered: dict[int, list[torch.Tensor]] = {}
        self.last_stage = schedule.num_stages - 1
        self.timeline: list[ActionTime] = []
        self.peak_held: dict[int, int] = {}  # stage -> most micro-batches whose saved activations were held at once
        self.peak_saved_bytes: dict[int, int] = {}

    def refresh_state(self) -> None:
        """The model's parameters and buffers as they are now, by name: ``to_empty``, ``load_state_dict(assign=True)``
        or a move may have put new tensors in place since the last step (see [Note: facts keyed by name, not by
        tensor] in ``model_state.py``)."""
        self.parameters = dict(self.model.named_parameters(remove_duplicate=False))
        self.state = {**self.parameters, **dict(self.model.named_buffers(remove_duplicate=False))}

    def _call(self, gm: fx.GraphModule, *args: Any) -> Sequence:
        """Run one of the stage graphs (or a variant of one): as Python, or as the code ``lower`` made of it."""
        if self.lower is None:
            return gm(*args)
        code = self.lowered.get(gm)
        if code is None:
            code = self.lowered[gm] = self.lower(gm, list(args))
        return code(*args)

    def _flat_shard(self, name: str) -> torch.Tensor:
        """A sharded parameter's rows (its ``Shard(0)`` DTensor's local part), flat and padded to its chunk."""
        local = self.state[name].detach().to_local().reshape(-1)
        return torch.nn.functional.pad(local, (0, self.chunks[name] - local.numel()))

    def _params(self, stage: int) -> list[torch.Tensor]:
        g = self.graphs[stage]
        params = self.gathered[stage] if stage in self.gather else [self.state[n] for n in g.parameter_names]
        return [*params, *(self.state[n] for n in g.buffer_names)]

    def _forward(self, action: Action, batch: list[torch.Tensor], carried: list[torch.Tensor]) -> Sequence:
        g = self.graphs[action.stage]
        if self.first_forward.get(action.stage) != action:
            return self._call(g.forward, *self._params(action.stage), *batch, *carried)
        shard = torch.cat([self._flat_shard(n) for n in g.parameter_names])
        buffers = [self.state[n] for n in g.buffer_names]
        result = self._call(self.gather[action.stage], shard, *buffers, *batch, *carried)
        self.gathered[action.stage] = list(result[len(result) - len(g.parameter_names):])  # kept for the step
        return result[: len(result) - len(g.parameter_names)]

    def _input_grads(self, key: tuple[int, int], input_grads: dict) -> list[torch.Tensor]:
        """Stage ``key[0]``'s input gradients for the previous stage; zeros where an input took none."""
        g = self.graphs[key[0]]
        specs = g.stage.carried_in
        return [
            grad if grad is not None else torch.zeros(specs[i].shape, dtype=specs[i].dtype)
            for i, grad in zip(g.grad_inputs, input_grads.pop(key))
        ]

    def _peer(self, stage: int) -> int:
        return self.groups.pp_ranks[self.schedule.stage_rank(stage)]

    # No autograd: the stage graphs already are the backward. Recorded, they would cost time, and each
    # gradient's grad_fn would keep its micro-batch's backward intermediates alive until the step ends.
    @torch.no_grad()
    def run(self, micro_batches: list[list[torch.Tensor]]) -> torch.Tensor:
        """``micro_batches[k]``: the k-th micro-batch of every user input. Returns this group's mean loss."""
        m = self.schedule.micro_batches
        self.refresh_state()
        received: dict[tuple[int, int], list[torch.Tensor]] = {}
        outputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        saved: dict[tuple[int, int], list] = {}
        output_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        input_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        stash: dict[tuple[int, int], list] = {}
        pending: list[tuple[dist.Work, list[torch.Tensor]]] = []
        stage_grads: dict[int, dict[int, torch.Tensor]] = {s: {} for s in self.graphs}  # stage -> position -> grad
        loss = torch.zeros(())
        scale = torch.full((), 1.0 / m)
        self.timeline = []
        self.peak_held = dict.fromkeys(self.graphs, 0)
        self.peak_saved_bytes = dict.fromkeys(self.graphs, 0)

        def accumulate(stage: int, grads: Sequence[torch.Tensor | None]) -> None:
            mine = stage_grads[stage]
            for position, grad in enumerate(grads):
                if grad is not None:
                    mine[position] = mine[position] + grad if position in mine else grad

        def backward(action: Action, graph_name: str, *args) -> Sequence:
            """Run the stage's graph, or its sync variant when this is the stage's last backward work."""
            variant = self.sync.get(action.stage)
            if variant is None or self.last_backward[action.stage] != action:
                return self._call(getattr(self.graphs[action.stage], graph_name), *args)
            mine = stage_grads[action.stage]
            params = self._params(action.stage)  # whole, also where they rest as shards
            accumulated = [mine.pop(i, None) for i in variant.accumulated]
            accumulated = [
                a if a is not None else torch.zeros_like(params[i]) for a, i in zip(accumulated, variant.accumulated)
            ]
            return self._call(variant.graph, *args, *accumulated)  # its gradients are the averaged totals

        def grads_in(key: tuple[int, int]) -> list[torch.Tensor]:
            if key[0] == self.last_stage:
                return [scale]
            if key in output_grads:
                return output_grads.pop(key)
            return self._input_grads((key[0] + 1, key[1]), input_grads)  # the next stage runs on this rank too

        def inputs_of(key: tuple[int, int]) -> list[torch.Tensor]:
            if key[0] == 0:
                return []
            if key in received:
                return received.pop(key)
            return outputs.pop((key[0] - 1, key[1]))  # the previous stage runs on this rank too

        for action in self.schedule.actions[self.groups.pp_rank]:
            start = time.perf_counter()
            s, k = action.stage, action.micro_batch
            key = (s, k)
            g = self.graphs.get(s)
            if action.op is Op.FORWARD:
                batch = [micro_batches[k][i] for i in g.stage.batch_inputs]
                result = self._forward(action, batch, inputs_of(key))
                outputs[key] = list(result[: g.num_outputs])
                saved[key] = list(result[g.num_outputs:])
                self._count_held(s, saved)
                if s == self.last_stage:
                    loss += outputs.pop(key)[0].detach()
            elif action.op is Op.BACKWARD:
                result = backward(action, "backward", *self._params(s), *saved.pop(key), *grads_in(key))
                input_grads[key] = list(result[: len(g.grad_inputs)])
                accumulate(s, result[len(g.grad_inputs):])
            elif action.op is Op.BACKWARD_INPUT:
                og = grads_in(key)
                result = self._call(g.backward_input, *self._params(s), *saved[key], *og)
                input_grads[key] = list(result[: len(g.grad_inputs)])
                stash[key] = [og, list(result[len(g.grad_inputs):])]
            elif action.op is Op.BACKWARD_WEIGHT:
                og, kept = stash.pop(key)
                accumulate(s, backward(action, "backward_weight", *self._params(s), *saved.pop(key), *og, *kept))
            elif action.op is Op.SEND_ACTIVATION:
                values = outputs.pop(key)
                pending += [self._send(v, s + 1, False, s, k, i) for i, v in enumerate(values)]
            elif action.op is Op.RECV_ACTIVATION:
                specs = g.stage.carried_in
                received[key] = self._recv([(sp.shape, sp.dtype) for sp in specs], s - 1, False, s - 1, k)
            elif action.op is Op.SEND_GRADIENT:
                values = self._input_grads(key, input_grads)
                pending += [self._send(v, s - 1, True, s - 1, k, i) for i, v in enumerate(values)]
            elif action.op is Op.RECV_GRADIENT:
                specs = g.stage.carried_out
                output_grads[key] = self._recv([(specs[i].shape, specs[i].dtype) for i in g.grad_outputs], s + 1, True, s, k)
            self.timeline.append(ActionTime(action, start, time.perf_counter()))
        for work, _ in pending:
            work.wait()
        self.gathered.clear()  # sharded at rest again
        self._write_grads(stage_grads)
        return self._mean_loss(loss / m)

    def _send(self, value: torch.Tensor, stage: int, gradient: bool, boundary: int, k: int, i: int):
        value = value.contiguous()
        return dist.isend(value, dst=self._peer(stage), group=self.groups.pp, tag=_tag(gradient, boundary, k, i)), [value]

    def _recv(self, shapes: list[tuple[tuple[int, ...], torch.dtype]], stage: int, gradient: bool, boundary: int, k: int) -> list[torch.Tensor]:
        buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
        works = [
            dist.irecv(b, src=self._peer(stage), group=self.groups.pp, tag=_tag(gradient, boundary, k, i))
            for i, b in enumerate(buffers)
        ]
        for w in works:  # a receive blocks: the schedule's contract
            w.wait()
        return buffers

    def _write_grads(self, stage_grads: dict[int, dict[int, torch.Tensor]]) -> None:
        param_grads: dict[int, torch.Tensor] = {}  # id(parameter) -> this rank's total over its stages
        by_id: dict[int, nn.Parameter] = {}
        for stage, grads in stage_grads.items():
            for position, grad in grads.items():
                p = self.parameters[self.graphs[stage].parameter_names[position]]
                by_id[id(p)] = p
                param_grads[id(p)] = param_grads[id(p)] + grad if id(p) in param_grads else grad
        if self.shared and self.groups.pp is not None:
            # A parameter read by stages on several ranks: each rank summed its own stages'
            # contributions; sum those over the pipeline group (zeros where a rank holds none).
            for name, (shape, dtype) in self.shared.items():
                p = self.parameters.get(name)  # None: released here (no stage of this rank reads it)
                mine = p is not None and id(p) in param_grads
                total = param_grads[id(p)] if mine else torch.zeros(shape, dtype=dtype)
                dist.all_reduce(total, group=self.groups.pp)
                if mine:
                    param_grads[id(p)] = total
        for key, grad in param_grads.items():
            p = by_id[key]
            grad = _as_shard(grad, p) if isinstance(p, DTensor) else grad.detach().clone()
            p.grad = grad if p.grad is None else p.grad + grad

    def _mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.groups.pp is not None:
            mine = loss if self.schedule.stage_rank(self.last_stage) == self.groups.pp_rank else torch.zeros(())
            dist.all_reduce(mine, group=self.groups.pp)
            loss = mine
        if self.groups.dp is not None and self.groups.dp_size > 1:
            dist.all_reduce(loss, group=self.groups.dp)
            loss = loss / self.groups.dp_size
        return loss

    def _count_held(self, stage: int, saved: dict[tuple[int, int], list]) -> None:
        held = [v for (s, _), v in saved.items() if s == stage]
        state = {local_part(t).untyped_storage().data_ptr() for t in self.state.values()}
        size = sum(  # activations only: a saved view of a weight (its transpose) costs nothing
            t.numel() * t.element_size() for v in held for t in pytree.tree_leaves(v)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in state
        )
        self.peak_held[stage] = max(self.peak_held[stage], len(held))
        self.peak_saved_bytes[stage] = max(self.peak_saved_bytes[stage], size)

    def measured_bubble(self) -> float:
        """Idle share of this rank's last step: 1 - time in F/B/I/W over the step's span."""
        if not self.timeline:
            return 0.0
        span = self.timeline[-1].end - self.timeline[0].start
        busy = sum(t.end - t.start for t in self.timeline if t.action.op.is_compute)
        return 1.0 - busy / span


def _as_shard(flat: torch.Tensor, param: DTensor) -> DTensor:
    """A reduce-scattered gradient chunk (padded) as the gradient of ``param``, a ``Shard(0)`` DTensor."""
    local_shape = param.to_local().shape
    local = flat.detach()[: local_shape.numel()].reshape(local_shape).clone()
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
                              run_check=False)
