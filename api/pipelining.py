"""``dpar.pipeline``: pipeline parallelism cut from the captured graph."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dpar.compiler.pipeline_parallel.data_parallel import SyncVariant, sync_variant
from dpar.compiler.pipeline_parallel.sharded import gather_variant, layout_of, reduce_scatter_variant
from dpar.compiler.pipeline_parallel.schedules import build_schedule, check_name, warn_if_bubble_large
from dpar.compiler.pipeline_parallel.split import StageSplit, capture, split_stages
from dpar.compiler.pipeline_parallel.stage_graphs import StageGraphs, trace_stage
from dpar.runtime.agreement import agree
from dpar.runtime.errors import OptionsError
from dpar.runtime.liveness import PIPELINE_STEP, watching
from dpar.runtime.pipeline_parallel import PipelineExecutor, PipelineGroups
from dpar.runtime.world import current_world

_ATTRIBUTE = "_dpar_pipeline"


def _groups(mesh: DeviceMesh | None) -> PipelineGroups:
    if mesh is None:
        world = current_world()
        if world is None:
            return PipelineGroups(None, (0,), 0, None, 1)
        return PipelineGroups(dist.group.WORLD, tuple(range(world.size)), world.rank, None, 1)
    names = mesh.mesh_dim_names or ()
    if "pp" not in names or not set(names) <= {"dp", "pp"}:
        raise OptionsError(
            f"pipeline: mesh dimensions {names} are not ('pp',) or ('dp', 'pp'); build it with "
            "init_device_mesh(device, (dp, pp), mesh_dim_names=('dp', 'pp'))."
        )
    pp = mesh.get_group("pp")
    dp = mesh.get_group("dp") if "dp" in names else None
    return PipelineGroups(
        pp, tuple(dist.get_process_group_ranks(pp)), mesh.get_local_rank("pp"), dp,
        mesh.size(names.index("dp")) if dp is not None else 1, mesh.get_local_rank("dp") if dp is not None else 0,
    )


class PipelineStep:
    """``step(*inputs, target)``: forward and backward of the pipeline group's whole batch.

    Accumulates into ``param.grad`` of this rank's stages' parameters (the others are released:
    each rank holds its stages only) and returns the mean loss on every rank.
    """

    def __init__(
        self, model: nn.Module, split: StageSplit, graphs: dict[int, StageGraphs], executor: PipelineExecutor,
        groups: PipelineGroups, example_shapes: tuple[tuple[int, ...], ...], full_shapes: dict[str, torch.Size],
    ) -> None:
        self.model = model
        self.split = split
        self.graphs = graphs
        self.executor = executor
        self.groups = groups
        self.example_shapes = example_shapes
        self.full_shapes = full_shapes

    @property
    def schedule(self):
        return self.executor.schedule

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        shapes = tuple(tuple(x.shape) for x in inputs)
        if shapes != self.example_shapes:
            raise OptionsError(
                f"pipeline: step was built for inputs of shapes {list(self.example_shapes)} and got {list(shapes)}; "
                "the stage graphs are captured at one micro-batch shape. Keep the per-rank batch shape fixed "
                "(drop_last=True in the DataLoader), or build another step for the other shape."
            )
        with watching(PIPELINE_STEP):  # a rank that vanishes mid-step is named: RankLostError
            batch = [self._gather(x) for x in inputs]
            m = self.schedule.micro_batches
            micro_batches = [list(chunk) for chunk in zip(*(x.chunk(m) for x in batch))]
            return self.executor.run(micro_batches)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """The pipeline group's batch: every member's slice, in pipeline order."""
        if self.groups.pp is None:
            return x
        parts = [torch.empty_like(x) for _ in self.groups.pp_ranks]
        dist.all_gather(parts, x.contiguous(), group=self.groups.pp)
        return torch.cat(parts)

    def measured_bubble(self) -> float:
        return self.executor.measured_bubble()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model on global rank 0 (None elsewhere): each parameter from the rank holding it."""
        by_name = dict(self.model.named_parameters(remove_duplicate=False))
        holder: dict[int, int] = {}  # id(parameter) -> the first stage reading it
        for stage in reversed(self.split.stages):
            holder.update({id(by_name[n]): stage.index for n in stage.parameters})
        state: dict[str, torch.Tensor] = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            stage = holder.get(id(value))
            if stage is None or self.groups.pp is None:  # a buffer, or read by no stage: every rank holds it
                state[name] = value.detach().clone()
                continue
            holder_rank = self.schedule.stage_rank(stage)
            shape = self.full_shapes[name]
            if holder_rank != self.groups.pp_rank:
                full = torch.empty(shape, dtype=value.dtype)
            elif value.shape == shape:
                full = value.detach().clone()
            else:  # a shard over dp (dp_strategy="fsdp"): gather it from the stage's dp group
                gathered = value.new_empty(value.numel() * self.groups.dp_size)
                dist.all_gather_into_tensor(gathered, value.detach(), group=self.groups.dp)
                full = gathered[: shape.numel()].view(shape).clone()
            dist.broadcast(full, src=self.groups.pp_ranks[holder_rank], group=self.groups.pp)
            state[name] = full
        return state if not dist.is_initialized() or dist.get_rank() == 0 else None


def _shard_over_dp(
    graphs: dict[int, StageGraphs], parameters: dict[str, nn.Parameter], groups: PipelineGroups, last: str
) -> tuple[dict[int, SyncVariant], dict[int, fx.GraphModule]]:
    """[Note: sharded data parallel across pipelines]: the variants, and each parameter replaced by its shard."""
    names = [n for g in graphs.values() for n in g.parameter_names]
    twice = sorted({n for n in names if sum(parameters[m] is parameters[n] for m in names) > 1})
    if twice:
        raise OptionsError(
            f"pipeline: dp_strategy='fsdp' cannot yet shard a parameter that two graphs on one rank read "
            f"({', '.join(twice)}: a tied weight within a stage, or in two stages of one rank); "
            "untie it, place the stages so that each rank reads it once, or use dp_strategy='ddp'."
        )
    group_name = groups.dp.group_name
    sync, gather = {}, {}
    for s, g in graphs.items():
        layout = layout_of(g, groups.dp_size)
        gather[s] = gather_variant(g, layout, group_name)
        sync[s] = reduce_scatter_variant(g, last, layout, group_name)
        for i, name in enumerate(g.parameter_names):
            param = parameters[name]
            param.data = layout.shard(param.data, i, groups.dp_rank)
    return sync, gather


def pipeline(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    example_inputs: Sequence[torch.Tensor],
    stages: int,
    micro_batches: int,
    schedule: str = "1f1b",
    mesh: DeviceMesh | None = None,
    split_points: Sequence[str] | None = None,
    dp_strategy: str = "ddp",
    bucket_cap_mb: float = 25,
) -> PipelineStep:
    """Cut ``model`` into ``stages`` pipeline stages and return the step that trains it.

    ``example_inputs`` is one rank's slice, ``(*model_inputs, target)``; ``loss_fn(model(*model_inputs),
    target)`` must be the micro-batch's mean loss. ``mesh``: None runs the pipeline over the whole
    world; a ``("dp", "pp")`` mesh runs one pipeline per ``dp`` index and averages gradients over
    ``dp``: ``dp_strategy="ddp"`` all-reduces them in buckets of ``bucket_cap_mb``, ``"fsdp"`` keeps
    1/dp of each stage's parameters, gradients and optimizer state per rank, gathered once per step.
    See ``[Note: the pipeline's data contract]`` in ``runtime/pipeline_parallel.py``.
    """
    if getattr(model, _ATTRIBUTE, None) is not None:
        raise OptionsError("pipeline: this model is already cut into stages; call dpar.pipeline once per model.")
    check_name(schedule)
    if dp_strategy not in ("ddp", "fsdp"):
        raise OptionsError(f"pipeline: dp_strategy={dp_strategy!r} is not one of 'ddp', 'fsdp'.")
    groups = _groups(mesh)
    p = len(groups.pp_ranks)
    if not isinstance(stages, int) or stages < 1 or stages % p:
        raise OptionsError(
            f"pipeline: stages={stages} cannot be spread over the {p} ranks of the pipeline group; use "
            f"stages={p} (one per rank), or a multiple of {p} with schedule='interleaved_1f1b'."
        )
    virtual = stages // p
    if schedule == "interleaved_1f1b" and virtual < 2:
        raise OptionsError(
            f"pipeline: interleaved_1f1b runs at least 2 stages on each rank: stages={2 * p} (or {3 * p}, {4 * p}, ...) "
            f"on {p} ranks, not stages={stages}; or use schedule='1f1b' for one stage per rank."
        )
    if virtual > 1 and schedule != "interleaved_1f1b":
        raise OptionsError(
            f"pipeline: stages={stages} on {p} ranks puts {virtual} stages on each rank, which only "
            f"schedule='interleaved_1f1b' runs; use stages={p} or that schedule."
        )
    plan = build_schedule(schedule, num_ranks=p, micro_batches=micro_batches, virtual_stages=virtual)
    rows = {x.shape[0] if x.dim() else None for x in example_inputs}
    if len(rows) != 1 or None in rows:
        raise OptionsError(
            f"pipeline: every example input needs the batch in dim 0 with the same number of rows; got shapes "
            f"{[tuple(x.shape) for x in example_inputs]}."
        )
    total = rows.pop() * p
    if total % micro_batches:
        divisors = [d for d in range(1, total + 1) if total % d == 0]
        raise OptionsError(
            f"pipeline: micro_batches={micro_batches} does not divide the pipeline group's batch of {total} rows "
            f"({p} ranks x {total // p} rows each); use one of {divisors}."
        )
    warn_if_bubble_large(schedule, p, micro_batches, virtual)
    micro_batch = tuple(torch.cat([x] * p)[: total // micro_batches] for x in example_inputs)
    split = split_stages(capture(model, loss_fn, micro_batch), model, stages, split_points)
    world = current_world()
    if world is not None and world.backend != "fake":  # every rank must have cut the same stages and schedule
        agree(world, "dpar.pipeline", [*str(split).splitlines(), *str(plan).splitlines(),
                                       f"inputs {[tuple(x.shape) for x in example_inputs]}"], timeout_s=120,
              subject="pipeline stage splits, schedules and input shapes")
    parameters = dict(model.named_parameters(remove_duplicate=False))
    state = parameters | dict(model.named_buffers(remove_duplicate=False))
    mine = plan.stages_of(groups.pp_rank)
    graphs = {s: trace_stage(split.stages[s], state, s == stages - 1, micro_batch) for s in mine}
    full_shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    read = {id(parameters[n]) for stage in split.stages for n in stage.parameters}
    held = {id(parameters[n]) for s in mine for n in split.stages[s].parameters}
    held |= {id(p) for p in parameters.values() if id(p) not in read}  # read by no stage: kept everywhere
    for param in model.parameters():
        if id(param) not in held:  # another rank's stage: release it
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    shared = {name: full_shapes[name] for name in split.shared_parameters}
    sync, gather = {}, {}
    if groups.dp is not None and groups.dp_size > 1:
        last = "backward_weight" if schedule == "zb_h1" else "backward"
        if dp_strategy == "ddp":  # [Note: data parallel across pipelines]
            sync = {
                s: sync_variant(g, last, group_name=groups.dp.group_name, dp_size=groups.dp_size,
                                cap_bytes=int(bucket_cap_mb * 2**20))
                for s, g in graphs.items()
            }
        else:
            sync, gather = _shard_over_dp(graphs, parameters, groups, last)
            shared = {name: parameters[name].shape for name in shared}  # each rank sums its shard
    executor = PipelineExecutor(plan, graphs, state, groups, shared, sync, gather)
    step = PipelineStep(model, split, graphs, executor, groups, tuple(tuple(x.shape) for x in example_inputs), full_shapes)
    object.__setattr__(model, _ATTRIBUTE, step)
    return step
