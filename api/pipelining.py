"""``dpar.pipeline``: pipeline parallelism cut from the captured graph."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dpar.initialization import replay_own_initializers
from dpar.placement import _mesh_device_type, activation_policy
from dpar.planner.plan import Plan
from dpar.compiler.lowering import STAGE_COMPILERS, lower_stage_graph
from dpar.compiler.megatron import megatron_plan
from dpar.compiler.optimizer_step import OPTIMIZER_STAGE
from dpar.compiler.pass_listing import PipelinePassListing
from dpar.compiler.propagation.propagate import MeshDim
from dpar.compiler.pipeline_parallel.sharded import layout_of
from dpar.compiler.pipeline_parallel.schedules import build_schedule, check_name, warn_if_bubble_large
from dpar.compiler.pipeline_parallel.split import capture, split_stages
from dpar.compiler.pipeline_parallel.stage_graphs import retarget_device_pass, trace_stage
from dpar.core.pipeline_program import StageGraphs, StageSplit, SyncVariant
from dpar.runtime.agreement import agree
from dpar.core.errors import OptionsError, TensorParallelPlanError, UnmaterializedStateError
from dpar.core.facts import TensorParallelSpec
from dpar.core.plan import DataParallel
from dpar.core.model_state import check_materialized, local_part, record_meta_state, state_of
from dpar.core.torch_internals import compute_local_shape_and_global_offset
from dpar.runtime.liveness import PIPELINE_STEP, watching
from dpar.runtime.optimizer_hooks import hand_down
from dpar.runtime.pipeline_parallel import PipelineExecutor, PipelineGroups
from dpar.runtime.forward_scope import count_eager_forwards
from dpar.runtime.parameter_writes import replay_writes_at_full_size
from dpar.surgery.tensor_parallel import install_markers, split_parameters, state_dict_mesh
from dpar.core.world import current_world

_ATTRIBUTE = "_dpar_pipeline"


def _as_planned(
    plan: Plan, model: nn.Module, example_inputs: Sequence[torch.Tensor], stages: int | None,
    micro_batches: int | None, schedule: str, dp_strategy: str, activation_checkpointing: Any,
    mesh: DeviceMesh | None,
) -> tuple[int, int, str, str, Any, DeviceMesh | None]:
    """What ``plan.pipeline`` fixes, refusing a keyword given beside it with another value, and its mesh."""
    layout = plan.pipeline
    if layout is None:
        raise OptionsError(f"pipeline: plan= is a placement plan ({plan.strategy}); apply it with "
                           "dpar.parallelize(model, plan=plan), or run dpar.plan(..., pipelines=True) for a pipeline")
    given = {"stages": (stages, None, layout.stages), "micro_batches": (micro_batches, None, layout.micro_batches),
             "schedule": (schedule, "1f1b", layout.schedule), "dp_strategy": (dp_strategy, "ddp", layout.dp_strategy)}
    clash = [f"{name}={value!r} (the plan's {planned!r})" for name, (value, default, planned) in given.items()
             if value not in (default, planned)]
    if clash:
        raise OptionsError(f"pipeline: plan= fixes {', '.join(clash)}; drop them, or plan again")
    world = math.prod(plan.mesh_shape)
    if dist.is_initialized() and dist.get_world_size() != world:
        raise OptionsError(f"pipeline: the plan is for {world} ranks ({layout.mesh}) but the world has "
                           f"{dist.get_world_size()}; plan for this world")
    rows = example_inputs[0].shape[0] if example_inputs and example_inputs[0].dim() else None
    if rows is None or rows * world != plan.batch_size:
        raise OptionsError(f"pipeline: the plan was priced at a global batch of {plan.batch_size} rows, "
                           f"{plan.batch_size // world} a rank, but example_inputs hold {rows} rows; feed each rank its "
                           "slice of the planned batch, or plan again")
    names, shape = layout.mesh_dims
    if mesh is None and names != ("pp",):
        mesh = init_device_mesh(_mesh_device_type(model), shape, mesh_dim_names=names)
    policy = plan.activations if activation_checkpointing is None else activation_checkpointing
    return layout.stages, layout.micro_batches, layout.schedule, layout.dp_strategy, policy, mesh


def _groups(mesh: DeviceMesh | None) -> PipelineGroups:
    if mesh is None:
        world = current_world()
        if world is None:
            return PipelineGroups(None, (0,), 0, None, 1)
        return PipelineGroups(dist.group.WORLD, tuple(range(world.size)), world.rank, None, 1)
    names = mesh.mesh_dim_names or ()
    if "pp" not in names or not set(names) <= {"dp", "pp", "tp"} or len(set(names)) != len(names):
        raise OptionsError(
            f"pipeline: mesh dimensions {names} are not ('pp',), ('dp', 'pp'), ('pp', 'tp') or ('dp', 'pp', 'tp'); "
            "build it with init_device_mesh(device, (dp, pp, tp), mesh_dim_names=('dp', 'pp', 'tp'))."
        )
    pp = mesh.get_group("pp")
    dp = mesh.get_group("dp") if "dp" in names else None
    tp = mesh.get_group("tp") if "tp" in names else None
    return PipelineGroups(
        pp, tuple(dist.get_process_group_ranks(pp)), mesh.get_local_rank("pp"), dp,
        mesh.size(names.index("dp")) if dp is not None else 1, mesh.get_local_rank("dp") if dp is not None else 0,
        tp, mesh.size(names.index("tp")) if tp is not None else 1, mesh.get_local_rank("tp") if tp is not None else 0,
    )


# [Note: a pipeline born on meta]
# A model too big for one device is built under ``torch.device("meta")``, cut into stages there, and only then
# materialized with ``model.to_empty(device=...)``, so that no rank ever holds more than its stages. The capture
# and the stage traces run on meta (the example inputs are moved there: ``torch.export`` will not mix meta and
# CPU tensors); they only need shapes. What a trace bakes in is the device of the tensors a forward creates
# (``arange``'s positions, a causal mask's ``scalar_tensor``): ``device=meta`` in the graphs, which the first
# step rewrites to the device the state was materialized on (``retarget_device_pass``), after checking that no
# parameter is still on meta and every buffer that was on meta has been written since (``check_materialized``:
# non-persistent buffers such as RoPE's ``inv_freq`` come from the model's own init, not from a state dict).
#
# [Note: a pipelined model's state]
# torch.distributed.pipelining's convention: each rank's ``model.state_dict()`` holds its stages' parameters
# (and every buffer), and the union over ranks is the whole model. Another stage's parameter is released: set to
# ``None`` in its module's ``_parameters`` (``named_parameters``, ``state_dict``, ``to_empty`` and optimizers all
# skip it), its name, shape and dtype kept in the model's ``ModelState`` (facts keyed by name, which survive
# ``to_empty``, ``swap_tensors`` and ``load_state_dict(assign=True)``). Under ``dp_strategy="fsdp"`` a held
# parameter is a ``Shard(0)`` DTensor over the mesh's ``dp`` dimension (torch's convention, as under
# ``dpar.parallelize``'s fsdp), so DCP, ``set_model_state_dict`` and ``dpar.checkpoint`` reshard it to and from
# any strategy. A root load-state-dict pre-hook drops the entries of released parameters (a full state dict
# loads on every rank, each keeping its stages); a pre-hook on each module holding a DTensor cuts a full tensor
# given for it to this rank's rows (there, after a parent's own hooks have built the entry). A module's state-dict
# hooks may name entries after no parameter: torchtitan's fused ``wqkv`` is saved as ``wq``, ``wk`` and ``wv``
# (and loaded back through its pre-hook). Such an entry belongs to the parameters of the deepest module its name
# is under: it is held where they are, and dropped on load where they are released.
# The executor looks the parameters up by name at every step. ``to_empty`` unties a tied weight (each module gets a
# parameter of its own, as HF's ``tie_weights()`` after it is there to undo): the step, the loads, ``init_weights``
# and ``full_state_dict`` tie the names ``dpar.pipeline`` found tied again first (``PipelineStep.retie``).
_WHOLE = "pipeline_whole"  # state-dict name -> (shape, dtype), for the whole model
_TIED = "pipeline_tied"  # state-dict name -> the first name of the same parameter or buffer
_HOLDER = "pipeline_holder"  # state-dict name -> the pipeline rank of the first stage reading its parameters
_MADE_OF = "pipeline_made_of"  # a state-dict name no parameter or buffer has -> the parameters it is made of
RELEASED = "pipeline_released"  # parameter name -> (shape, dtype): another rank's stage holds it


class PipelineStep:
    """``step(*inputs, target)``: forward and backward of the pipeline group's whole batch.

    Accumulates into ``param.grad`` of this rank's stages' parameters (the others are released:
    each rank holds its stages only) and returns the mean loss on every rank.
    """

    def __init__(
        self, model: nn.Module, split: StageSplit, graphs: dict[int, StageGraphs], executor: PipelineExecutor,
        groups: PipelineGroups, example_shapes: tuple[tuple[int, ...], ...], born_on_meta: bool = False,
    ) -> None:
        self.model = model
        self.split = split
        self.graphs = graphs
        self.executor = executor
        self.groups = groups
        self.example_shapes = example_shapes
        self._traced_on_meta = born_on_meta

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
        self.retie()
        if self._traced_on_meta:
            self._retarget()
        with watching(PIPELINE_STEP):  # a rank that vanishes mid-step is named: RankLostError
            batch = [self._gather(x) for x in inputs]
            m = self.schedule.micro_batches
            micro_batches = [list(chunk) for chunk in zip(*(x.chunk(m) for x in batch))]
            return self.executor.run(micro_batches)

    def retie(self) -> None:
        """[Note: a pipelined model's state]: every name of a parameter that was tied when ``dpar.pipeline`` ran reads
        the first name's parameter again. ``to_empty`` (``nn.Module._apply``) gives each module a new parameter of
        its own; a tie the stages were cut for would silently train as two halves."""
        for name, first in state_of(self.model).facts(_TIED).items():
            if name == first:
                continue
            module_name, _, leaf = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            first_module, _, first_leaf = first.rpartition(".")
            target = self.model.get_submodule(first_module)._parameters.get(first_leaf)
            current = module._parameters.get(leaf)
            if current is not None and target is not None and current is not target:
                module._parameters[leaf] = target

    def _graph_modules(self) -> list[fx.GraphModule]:
        kinds = ("forward", "backward", "backward_input", "backward_weight")
        return [
            *(getattr(g, k) for g in self.graphs.values() for k in kinds), *self.executor.gather.values(),
            *(v.graph for v in self.executor.sync.values()),
        ]

    def _retarget(self) -> None:
        """[Note: a pipeline born on meta]: the first step after ``to_empty`` points the graphs at the device."""
        self.executor.refresh_state()
        parameters, state = self.executor.parameters, self.executor.state
        check_materialized([("parameter" if n in parameters else "buffer", n, t) for n, t in state.items()])
        device = next((local_part(t).device for t in state.values()), torch.device("cpu"))
        for gm in self._graph_modules():
            constants = [n.target for n in gm.graph.nodes if n.op == "get_attr"
                         and isinstance(getattr(gm, n.target, None), torch.Tensor) and getattr(gm, n.target).is_meta]
            if constants:
                raise UnmaterializedStateError(
                    f"pipeline: the graph traced on meta holds tensor constants with no values "
                    f"({', '.join(constants)}); build the model on the device it trains on (not meta) to pipeline it."
                )
            retarget_device_pass(gm, device)
        self._traced_on_meta = False

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """The pipeline group's batch: every member's slice, in pipeline order; under tensor parallel, then
        every tensor-parallel peer's pipeline batch, in ``tp`` order (the same rows on every rank of the group)."""
        for group, size in ((self.groups.pp, len(self.groups.pp_ranks)), (self.groups.tp, self.groups.tp_size)):
            if group is not None and size > 1:
                parts = [torch.empty_like(x) for _ in range(size)]
                dist.all_gather(parts, x.contiguous(), group=group)
                x = torch.cat(parts)
        return x

    def measured_bubble(self) -> float:
        return self.executor.measured_bubble()

    def whole_model(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Every tensor of the whole model's state dict (every rank's stages), by name: its shape and dtype."""
        return dict(state_of(self.model).facts(_WHOLE))

    def first_names(self) -> dict[str, str]:
        """Each state-dict name -> the first name of the same tensor (a tied weight: one tensor, several names)."""
        return dict(state_of(self.model).facts(_TIED))

    def released(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """The parameters another rank's stages hold, by name: their shape and dtype."""
        return dict(state_of(self.model).facts(RELEASED))

    def full_tensor(self, name: str, local: dict[str, torch.Tensor]) -> torch.Tensor:
        """The whole of state-dict entry ``name`` on every rank of this rank's pipeline group, from the rank whose
        stage holds it (``local``: this rank's ``model.state_dict()``). A collective: every rank calls it for the
        same names in the same order."""
        shape, dtype = state_of(self.model).facts(_WHOLE)[name]
        holder = state_of(self.model).facts(_HOLDER).get(name)
        everywhere = holder is None or self.groups.pp is None  # a buffer, or read by no stage: every rank holds it
        if everywhere or holder == self.groups.pp_rank:
            value = local[name].detach()
            full = (value.full_tensor() if isinstance(value, DTensor) else value).to("cpu", copy=True)
        else:
            full = torch.empty(shape, dtype=dtype)
        if not everywhere:
            dist.broadcast(full, src=self.groups.pp_ranks[holder], group=self.groups.pp)
        return full

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model on global rank 0 (None elsewhere): each parameter from the rank holding it, one at a time."""
        keep = not dist.is_initialized() or dist.get_rank() == 0
        self.retie()
        local = self.model.state_dict()
        first = self.first_names()
        state: dict[str, torch.Tensor] = {}
        gathered: set[str] = set()
        for name in self.whole_model():
            key = first.get(name, name)
            if key not in gathered:
                gathered.add(key)
                full = self.full_tensor(name, local)
                if keep:
                    state[key] = full
            if keep:
                state[name] = state[key]
        return state if keep else None


def _holders(split: StageSplit, parameters: dict[str, nn.Parameter], plan) -> dict[str, int]:  # noqa: ANN001
    """Each parameter name a stage reads (under any of its tied names) -> the pipeline rank of the first such stage."""
    first: dict[int, int] = {}  # id(parameter) -> the first stage reading it (ids of live parameters, this call only)
    for stage in reversed(split.stages):
        first.update({id(parameters[n]): stage.index for n in stage.parameters})
    return {n: plan.stage_rank(first[id(p)]) for n, p in parameters.items() if id(p) in first}


def _record_whole_model(model: nn.Module, holders: dict[str, int]) -> None:
    """[Note: a pipelined model's state]: the whole model's names, shapes, dtypes, ties and holders, by name."""
    state = state_of(model, create=True)
    first: dict[int, str] = {}
    tensors = dict(model.named_parameters(remove_duplicate=False))
    parameters = list(tensors)
    tensors.update(model.named_buffers(remove_duplicate=False))
    module_names = {name for name, _ in model.named_modules(remove_duplicate=False)}
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        state.set_fact(_WHOLE, name, (value.shape, value.dtype))
        state.set_fact(_TIED, name, first.setdefault(id(tensors.get(name, value)), name))
        if name in holders:
            state.set_fact(_HOLDER, name, holders[name])
        elif name not in tensors:  # made by a module's state-dict hook
            made_of = _parameters_under(_owning_module(module_names, name), parameters)
            ranks = {holders[p] for p in made_of if p in holders}
            if len(ranks) > 1:
                raise OptionsError(
                    f"pipeline: state-dict entry {name!r} is made by a state_dict hook from parameters that stages on "
                    f"different pipeline ranks read ({', '.join(made_of)}): no rank holds all of it. Cut the stages "
                    "so that one stage reads them all, or remove the hook."
                )
            state.set_fact(_MADE_OF, name, made_of)
            if ranks:
                state.set_fact(_HOLDER, name, ranks.pop())


def _owning_module(module_names: set[str], name: str) -> str:
    """The deepest of ``module_names`` that ``name`` is under ('' for the root)."""
    parts = name.split(".")
    return next((p for i in range(len(parts) - 1, 0, -1) if (p := ".".join(parts[:i])) in module_names), "")


def _parameters_under(module_name: str, parameters: list[str]) -> tuple[str, ...]:
    return tuple(p for p in parameters if not module_name or p.startswith(module_name + "."))


def _release(model: nn.Module, names: set[str]) -> None:
    """Another rank's stages' parameters: ``None`` in their modules, their shape and dtype kept by name."""
    state = state_of(model, create=True)
    for name in sorted(names):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = module._parameters[leaf]
        if param is not None:
            state.set_fact(RELEASED, name, (param.shape, param.dtype))
            module._parameters[leaf] = None


def _accept_pipeline_state(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:  # noqa: ANN002
    """``load_state_dict`` pre-hook of a pipelined root: see [Note: a pipelined model's state]."""
    state = state_of(module)
    if state is None:
        return
    module.__dict__[_ATTRIBUTE].retie()
    released = state.facts(RELEASED)
    for name in released:
        state_dict.pop(prefix + name, None)
    for name, made_of in state.facts(_MADE_OF).items():
        if made_of and all(p in released for p in made_of):
            state_dict.pop(prefix + name, None)


def _cut_full_tensors_to_shards(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:  # noqa: ANN002
    """``load_state_dict`` pre-hook of a module holding DTensors: see [Note: a pipelined model's state]."""
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and value.shape == param.shape:
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            rows = value.narrow(0, offset[0], shape[0])
            state_dict[prefix + name] = DTensor.from_local(
                rows, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
            )


def _shard_over_dp(
    model: nn.Module, graphs: dict[int, StageGraphs], parameters: dict[str, nn.Parameter], groups: PipelineGroups,
    mesh: DeviceMesh, passes: PipelinePassListing,
) -> tuple[dict[int, SyncVariant], dict[int, fx.GraphModule], dict[str, int]]:
    """[Note: sharded data parallel across pipelines]: the variants, each parameter replaced by its ``Shard(0)``
    DTensor over ``dp``, and each sharded name's padded chunk length."""
    names = [n for g in graphs.values() for n in g.parameter_names]
    twice = sorted({n for n in names if sum(parameters[m] is parameters[n] for m in names) > 1})
    if twice:
        raise OptionsError(
            f"pipeline: dp_strategy='fsdp' cannot yet shard a parameter that two graphs on one rank read "
            f"({', '.join(twice)}: a tied weight within a stage, or in two stages of one rank); "
            "untie it, place the stages so that each rank reads it once, or use dp_strategy='ddp'."
        )
    dp_mesh = mesh["dp"]
    sync, gather, chunks = {}, {}, {}
    for s, g in graphs.items():
        layout = layout_of(g, groups.dp_size)
        gather[s] = passes.gather_variant(g, layout)
        sync[s] = passes.sync_variant(g, layout)
        for i, name in enumerate(g.parameter_names):
            param = parameters[name]
            start, length = layout.rows(i, groups.dp_rank)
            local = param.detach().narrow(0, start, length).clone()
            shard = DTensor.from_local(
                local, dp_mesh, [Shard(0)], shape=param.shape, stride=param.stride(), run_check=False
            )
            shard = nn.Parameter(shard, requires_grad=param.requires_grad)
            for other, p in parameters.items():  # every name of it (a tied weight read on another rank's stage too)
                if p is param:
                    module_name, _, leaf = other.rpartition(".")
                    model.get_submodule(module_name)._parameters[leaf] = shard
                    chunks[other] = layout.chunks[i]
    return sync, gather, chunks


def _check_tensor_parallel(
    groups: PipelineGroups, tp_plan: dict[str, int | None] | None, sequence_parallel: bool) -> None:
    """The tensor-parallel options name a ``tp`` mesh dimension."""
    if groups.tp is None and (tp_plan is not None or sequence_parallel):
        raise OptionsError(
            "pipeline: tp_plan and sequence_parallel split each stage over a mesh's 'tp' dimension, and the mesh has "
            "none; pass init_device_mesh(device, (dp, pp, tp), mesh_dim_names=('dp', 'pp', 'tp'))."
        )


def _split_over_tp(
    model: nn.Module, split: StageSplit, groups: PipelineGroups, mesh: DeviceMesh, model_inputs: Sequence[torch.Tensor],
    tp_plan: dict[str, int | None] | None, sequence_parallel: bool,
) -> tuple[dict[str, TensorParallelSpec], MeshDim]:
    """[Note: tensor parallel inside a pipeline stage]: each split parameter replaced by this rank's block, as
    ``dpar.parallelize(strategy="tp")`` splits it (Megatron's plan unless ``tp_plan`` names the dims), checked
    before anything runs; returns the split parameters' specs by every name, and the ``tp`` dimension."""
    planned = megatron_plan(model, model_inputs)
    dims = planned.dims if tp_plan is None else dict(tp_plan)
    staged = {n for stage in split.stages for n in stage.parameters}
    outside = sorted(set(dims) - staged)
    if tp_plan is not None and outside:
        raise TensorParallelPlanError(
            f"pipeline: tp_plan names {', '.join(map(repr, outside))}, which no stage reads (not a parameter of the "
            f"model, or one its forward never uses); name the parameters of the stages: {', '.join(sorted(staged))}."
        )
    size = groups.tp_size
    uneven = {name: units for name, units in planned.units.items() if dims.get(name) is not None and units % size}
    if uneven:
        raise TensorParallelPlanError(
            f"pipeline: a tp degree of {size} does not divide the units a view cuts the output of "
            + ", ".join(f"{name} into ({units})" for name, units in sorted(uneven.items()))
            + " (attention heads, or the q/k/v parts of a fused projection); each rank must hold whole units, so "
            f"choose a tp degree that divides them, or keep those layers replicated "
            f"(tp_plan={{{', '.join(f'{n!r}: None' for n in sorted(uneven))}, ...}})."
        )
    splits = split_parameters(model, dims, groups.tp)
    count_eager_forwards(model)  # see [Note: a parameter is its parameter]
    names = mesh.mesh_dim_names
    # State-dict DTensors over ("tp", "dp") of this pipeline position, as parallelize's ddp+tp and fsdp+tp have them.
    install_markers(model, splits, state_dict_mesh(mesh["tp"], mesh["dp"], mesh["dp", "tp"]) if "dp" in names
                    else mesh["tp"])
    specs = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for leaf, spec in splits.get(module, {}).items():
            if spec.dim is not None:
                specs[f"{module_name}.{leaf}" if module_name else leaf] = spec
    tp = MeshDim(size=size, rank=groups.tp_rank, group_name=groups.tp.group_name, sequence_parallel=sequence_parallel)
    return specs, tp


def pipeline(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    example_inputs: Sequence[torch.Tensor],
    stages: int | None = None,
    micro_batches: int | None = None,
    schedule: str = "1f1b",
    mesh: DeviceMesh | None = None,
    split_points: Sequence[str] | None = None,
    dp_strategy: str = "ddp",
    bucket_cap_mb: float = 25,
    activation_checkpointing: Any = None,
    tp_plan: dict[str, int | None] | None = None,
    sequence_parallel: bool = False,
    compiler: str = "aot_eager",
    plan: Plan | None = None,
) -> PipelineStep:
    """Cut ``model`` into ``stages`` pipeline stages and return the step that trains it.

    ``plan``: a pipeline plan from ``dpar.plan`` (``plan.pipeline`` set) gives ``stages``, ``micro_batches``,
    ``schedule``, ``dp_strategy``, the activation policy and, where ``mesh`` is None, the mesh (see
    [Note: one answer over placements and pipelines] in ``api/planning.py``).

    ``example_inputs`` is one rank's slice, ``(*model_inputs, target)``; ``loss_fn(model(*model_inputs),
    target)`` must be the micro-batch's mean loss. ``schedule``: ``gpipe``, ``1f1b``, ``zb_h1`` (``stages`` = the
    pipeline's ranks), ``interleaved_1f1b`` (a multiple of them, looping) or ``zbv`` (twice them, in a V: rank ``r``
    holds stages ``r`` and ``2p - 1 - r``); see ``compiler/pipeline_parallel/schedules.py``. ``mesh``: None runs
    the pipeline over the whole world; a ``("dp", "pp")`` mesh runs one pipeline per ``dp`` index and averages
    gradients over ``dp``: ``dp_strategy="ddp"`` all-reduces them in buckets of ``bucket_cap_mb``, ``"fsdp"`` keeps
    1/dp of each stage's parameters, gradients and optimizer state per rank, gathered once per step.
    See ``[Note: the pipeline's data contract]`` in ``runtime/pipeline_parallel.py``. A mesh with a ``tp``
    dimension (``("dp", "pp", "tp")`` or ``("pp", "tp")``) also splits each stage's layers over ``tp``, Megatron-style
    as ``dpar.parallelize(strategy="tp")`` does (``tp_plan``: parameter name -> dim or None, default from a
    fake forward; ``sequence_parallel`` as there), either ``dp_strategy`` over ``dp`` (fsdp shards each rank's
    blocks); see [Note: tensor parallel inside a pipeline stage] in ``compiler/pipeline_parallel/stage_graphs.py``.

    ``model`` may be built on the meta device: cut it here, then ``model.to_empty(device=...)`` allocates this rank's
    stages only (its ``dp`` shard of them under ``"fsdp"``); load weights (``set_model_state_dict``, ``dcp.load``,
    ``dpar.checkpoint.load``, ``load_safetensors``) or ``dpar.init_weights`` before the first step. Each rank's
    ``model.state_dict()`` holds its stages' tensors (DTensors under ``"fsdp"``). See ``[Note: a pipeline born on
    meta]`` and ``[Note: a pipelined model's state]``.

    ``activation_checkpointing``: as ``dpar.parallelize`` takes it (``keep``, ``selective``, ``full``, or
    ``{block: name}``, or an ``ActivationPolicy(budget_bytes=...)``: saved bytes per stage and micro-batch): each
    stage's backward computes again what its blocks' policy recomputes; see [Note: activation checkpointing inside a pipeline stage] in
    ``compiler/pipeline_parallel/stage_graphs.py``.

    ``compiler``: ``"aot_eager"`` runs the stage graphs as Python ATen calls; ``"inductor"`` lowers each one with
    Inductor at its first run (every schedule, zero-bubble ones included) and compiles the step of every optimizer
    over the model's parameters from its second step, as ``dpar.parallelize`` does; see [Note: compiled pipeline
    stages] in ``compiler/lowering.py``.
    """
    if getattr(model, _ATTRIBUTE, None) is not None:
        raise OptionsError("pipeline: this model is already cut into stages; call dpar.pipeline once per model.")
    if plan is not None:
        stages, micro_batches, schedule, dp_strategy, activation_checkpointing, mesh = _as_planned(
            plan, model, example_inputs, stages, micro_batches, schedule, dp_strategy, activation_checkpointing, mesh)
    elif stages is None or micro_batches is None:
        raise OptionsError("pipeline: give stages= and micro_batches=, or plan= (a pipeline plan from dpar.plan)")
    activations = activation_policy(model, activation_checkpointing)
    check_name(schedule)
    if compiler not in STAGE_COMPILERS:
        raise OptionsError(
            f"pipeline: compiler={compiler!r} is not one of {list(STAGE_COMPILERS)}; 'inductor' compiles the stage "
            "graphs, 'aot_eager' runs them as Python."
        )
    data_parallel = DataParallel.parse(dp_strategy, (DataParallel.DDP, DataParallel.FSDP), prefix="pipeline: ")
    groups = _groups(mesh)
    _check_tensor_parallel(groups, tp_plan, sequence_parallel)
    p = len(groups.pp_ranks)
    if not isinstance(stages, int) or stages < 1 or stages % p:
        raise OptionsError(
            f"pipeline: stages={stages} cannot be spread over the {p} ranks of the pipeline group; use "
            f"stages={p} (one per rank), or a multiple of {p} with schedule='interleaved_1f1b' ({2 * p} with 'zbv')."
        )
    virtual = stages // p
    if schedule == "zbv" and virtual != 2:
        raise OptionsError(
            f"pipeline: zbv runs exactly 2 stages on each rank, in a V (rank r holds stages r and {2 * p - 1} - r): "
            f"stages={2 * p} on {p} ranks, not stages={stages}; or use schedule='zb_h1' with stages={p}."
        )
    if schedule == "interleaved_1f1b" and virtual < 2:
        raise OptionsError(
            f"pipeline: interleaved_1f1b runs at least 2 stages on each rank: stages={2 * p} (or {3 * p}, {4 * p}, ...) "
            f"on {p} ranks, not stages={stages}; or use schedule='1f1b' for one stage per rank."
        )
    if virtual > 1 and schedule not in ("interleaved_1f1b", "zbv"):
        raise OptionsError(
            f"pipeline: stages={stages} on {p} ranks puts {virtual} stages on each rank, which only "
            f"schedule='interleaved_1f1b' runs (or 'zbv', with 2); use stages={p} or that schedule."
        )
    plan = build_schedule(schedule, num_ranks=p, micro_batches=micro_batches, virtual_stages=virtual)
    rows = {x.shape[0] if x.dim() else None for x in example_inputs}
    if len(rows) != 1 or None in rows:
        raise OptionsError(
            f"pipeline: every example input needs the batch in dim 0 with the same number of rows; got shapes "
            f"{[tuple(x.shape) for x in example_inputs]}."
        )
    fed = p * groups.tp_size  # the ranks whose slices one pipeline trains on
    total = rows.pop() * fed
    if total % micro_batches:
        divisors = [d for d in range(1, total + 1) if total % d == 0]
        raise OptionsError(
            f"pipeline: micro_batches={micro_batches} does not divide the pipeline group's batch of {total} rows "
            f"({fed} ranks x {total // fed} rows each); use one of {divisors}."
        )
    warn_if_bubble_large(schedule, p, micro_batches, virtual)
    micro_batch = tuple(torch.cat([x] * fed)[: total // micro_batches] for x in example_inputs)
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    if on_meta:  # [Note: a pipeline born on meta]
        micro_batch = tuple(x.to("meta") for x in micro_batch)
        record_meta_state(model)
    split = split_stages(capture(model, loss_fn, micro_batch), model, stages, split_points, ranks=p, schedule=schedule)
    world = current_world()
    if world is not None and world.backend != "fake":  # every rank must have cut the same stages and schedule
        agree(world, "dpar.pipeline", [*str(split).splitlines(), *str(plan).splitlines(),
                                       f"inputs {[tuple(x.shape) for x in example_inputs]}"], timeout_s=120,
              subject="pipeline stage splits, schedules and input shapes")
    specs, tp = _split_over_tp(model, split, groups, mesh, micro_batch[:-1], tp_plan, sequence_parallel) \
        if groups.tp is not None else ({}, None)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    state = parameters | dict(model.named_buffers(remove_duplicate=False))
    mine = plan.stages_of(groups.pp_rank)
    graphs = {s: trace_stage(split.stages[s], state, s == stages - 1, micro_batch, specs, tp, activations) for s in mine}
    holders = _holders(split, parameters, plan)
    _record_whole_model(model, holders)
    held = {id(parameters[n]) for s in mine for n in split.stages[s].parameters}  # this call only
    _release(model, {n for n, p in parameters.items() if n in holders and id(p) not in held})
    shared = {name: (parameters[name].shape, parameters[name].dtype) for name in split.shared_parameters}
    sync, gather, chunks = {}, {}, {}
    if groups.dp is not None and groups.dp_size > 1:  # the passes over dp: compiler/pass_listing.py
        passes = PipelinePassListing(data_parallel, groups.dp_size, schedule, group_name=groups.dp.group_name,
                                     bucket_cap_mb=bucket_cap_mb)
        if data_parallel is DataParallel.DDP:  # [Note: data parallel across pipelines]
            sync = {s: passes.sync_variant(g) for s, g in graphs.items()}
        else:
            sync, gather, chunks = _shard_over_dp(model, graphs, parameters, groups, mesh, passes)
            dp = groups.dp_size  # each rank sums its shard of a shared parameter (padded to whole rows)
            shared = {n: ((-(-shape[0] // dp) * shape[1:].numel(),), dtype) for n, (shape, dtype) in shared.items()}
    lower = None
    if compiler == "inductor":  # [Note: compiled pipeline stages]
        lower = lower_stage_graph
        hand_down(OPTIMIZER_STAGE, model.parameters(), in_graph=model.parameters())
    executor = PipelineExecutor(plan, graphs, model, groups, shared, sync, gather, chunks, lower)
    step = PipelineStep(model, split, graphs, executor, groups, tuple(tuple(x.shape) for x in example_inputs),
                        born_on_meta=on_meta)
    model.register_load_state_dict_pre_hook(_accept_pipeline_state)
    for module in model.modules():
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            module.register_load_state_dict_pre_hook(_cut_full_tensors_to_shards)
    object.__setattr__(model, _ATTRIBUTE, step)
    # A stage's parameters are parameters too: see [Note: a write the part cannot take as it stands] and [Note: the
    # model's own initializer, called on a parallelized model].
    replay_writes_at_full_size()
    replay_own_initializers(model)
    return step
