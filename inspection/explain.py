"""``dpar.explain``: compile a model for N simulated ranks and report what dpar did to it."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from dpar.compiler.backend import dpar_backend
from dpar.compiler.capture import GraphInput, classify_inputs, training_call_kwargs
from dpar.compiler.passes.buckets import BUCKET_REASON
from dpar.inspect.buckets import bucket_of, graph_buckets
from dpar.compiler.costs import (
    DeviceSpec, assumed_device, attention_fused, device_spec, link_time, moved_bytes, payload_bytes, tensor_host_time,
)
from dpar.inspect.fake_world import fake_world
from dpar.compiler.kernel_profile import timing_device, with_kernel_times
from dpar.compiler.logs import artifact
from dpar.compiler.memory import step_peak
from dpar.inspect.memory import per_rank_memory
from dpar.compiler.step_costs import graph_costs, is_meta
from dpar.inspect.meta import differentiable_on_meta
from dpar.inspect.report import BucketRow, CollectiveRow, GraphView, Report, dtype_name
from dpar.inspect.strategies import Parallelize, strategy as strategy_named
from dpar.inspect.timeline import build_timeline
from dpar.compiler.lowering import GraphRole, Lower, compile_graphs
from dpar.compiler.options import Options
from dpar.compiler.sharded_data_parallel import flat_layout
from dpar.compiler.registry import CompiledGraph, PassStage, record, recording
from dpar.core.errors import InspectionError, OptionsError
from dpar.core.torch_internals import functorch_config
from dpar.core.world import group_ranks, group_size

if TYPE_CHECKING:
    from dpar.inspect.pipeline import PipelineReport


@dataclasses.dataclass(frozen=True)
class _Capture:
    """What one Dynamo graph became: its inputs, their names and the graphs dpar compiled from it."""

    inputs: tuple[GraphInput, ...]
    input_names: tuple[str, ...]
    graphs: tuple[CompiledGraph, ...]
    sub_groups: dict[str, tuple[int, ...]]  # the sub-groups (a mesh dimension) its collectives use: name -> ranks

    def role(self, prefix: str) -> CompiledGraph | None:
        return next((g for g in self.graphs if g.label.startswith(prefix)), None)

    def flat_names(self, forward: fx.GraphModule) -> tuple[dict[int, str], dict[int, str]]:
        """Input names by flat forward-input position, and by backward-output (gradient) position.

        They differ from Dynamo's positions where a DTensor parameter flattens
        into its local shard and opaque spec objects.
        """
        values = [n.meta.get("val") for n in forward.graph.nodes if n.op == "placeholder"]
        layout = flat_layout(self.inputs, values)
        return (
            {start: name for (start, _), name in zip(layout, self.input_names)},
            {gradient: name for (_, gradient), name in zip(layout, self.input_names)},
        )


def _record_unchanged(gm: fx.GraphModule, example_inputs: Sequence[Any], role: GraphRole, lower: Lower):
    """At N = 1 dpar adds nothing; record the captured graph so the report still shows it."""
    gm.meta.setdefault("dpar_pass_stages", (PassStage.of("captured", gm),))
    record(f"{role.value} graph" if role is not GraphRole.BACKWARD else "backward graph (sync)", gm, [])
    return lower(gm, example_inputs)


def _capture(
    model: torch.nn.Module, example_inputs: Any, options: Mapping[str, Any], world_size: int, on_meta: bool = False
) -> list[_Capture]:
    captures: list[_Capture] = []
    state_names = {
        id(t): name
        for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
        for name, t in named
    }

    def backend(gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        if on_meta:  # see [Note: attention on meta] in compiler/costs.py
            gm = attention_fused(gm)
        graph_inputs = tuple(classify_inputs(gm, inputs))
        names = tuple(state_names.get(id(v), i.name) for i, v in zip(graph_inputs, inputs))
        with recording() as graphs:
            if world_size == 1:
                compiled = compile_graphs(gm, inputs, compiler="aot_eager", hook=_record_unchanged)
            else:
                compiled = dpar_backend(gm, inputs, options=options)
        groups = {c.group for g in graphs for c in g.collectives}
        sub_groups = {name: tuple(group_ranks(name)) for name in groups if group_size(name) != world_size}
        captures.append(_Capture(graph_inputs, names, tuple(graphs), sub_groups))
        return compiled

    compiled = torch.compile(model, backend=backend)
    # Compile the backward with the forward, so each graph pairs with its Dynamo graph.
    with functorch_config().patch(force_non_lazy_backward_lowering=True):
        if isinstance(example_inputs, Mapping):
            compiled(**example_inputs, **training_call_kwargs(model, 0, list(example_inputs)))
        elif isinstance(example_inputs, (tuple, list)):
            compiled(*example_inputs, **training_call_kwargs(model, len(example_inputs)))
        else:
            compiled(example_inputs, **training_call_kwargs(model, 1))
    return captures


def _positional(example_inputs: Any) -> tuple[Any, ...] | None:
    """The inputs as positional arguments, for a strategy that plans from them (None for keywords)."""
    if isinstance(example_inputs, Mapping):
        return None
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def explain(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    world_size: int,
    strategy: str = "ddp",
    options: Mapping[str, Any] | None = None,
    device: str | DeviceSpec = "h100",
    optimizer: str = "adamw",
    ranks_shown: int = 4,
    profile_kernels: bool = False,
    parallelize: Parallelize | None = None,
    build_pipeline: Callable[..., Any] | None = None,
    **pipeline: Any,
) -> Report | PipelineReport:
    """Compile a copy of ``model`` for ``world_size`` ranks, in this process, and report on it.

    ``example_inputs`` is a tuple of positional arguments, a dict of keyword
    arguments, or one tensor. ``options`` are the backend's (bucket_cap_mb,
    sink_waits, ...); the inner compiler is always aot_eager. ``device`` names a
    preset of ``dpar.compiler.costs.PRESETS`` or is a ``DeviceSpec``.
    The model and any process group state are left as they were: a sharding
    ``strategy`` (zero2, fsdp) runs ``dpar.parallelize`` on the copy, inside the
    simulated world. ``strategy="pipeline"`` takes ``explain_pipeline``'s keywords
    (``stages``, ``micro_batches``, ``schedule``, ``loss_fn``, ...) and returns its
    ``PipelineReport``: the stage split, the schedule and its simulated timeline. ``profile_kernels``
    times every kernel of the compiled graphs on this machine's device (CUDA where there is one, else the
    CPU) and prices them at their measured times instead of the roofline (see [Note: profile-guided
    kernel costs] in ``dpar.compiler.costs``); ``device`` must then describe this machine. ``parallelize`` is
    ``dpar.parallelize`` and ``build_pipeline`` ``dpar.pipeline`` (for ``tensor_parallel`` stages), handed down
    by ``dpar.explain`` (inspection does not import the api).
    """
    if strategy == "pipeline":
        from dpar.inspect.pipeline import explain_pipeline

        if options:
            raise OptionsError(f"explain: options {sorted(options)} are the compiler's; strategy='pipeline' takes none")
        return explain_pipeline(model, example_inputs, world_size=world_size, device=device, optimizer=optimizer,
                                pipeline=build_pipeline, profile_kernels=profile_kernels, **pipeline)
    if pipeline:
        raise OptionsError(f"explain: {sorted(pipeline)} apply only to strategy='pipeline'; drop them or use that strategy")
    chosen = strategy_named(strategy)
    spec = device_spec(device)
    timed_on = timing_device(spec) if profile_kernels else None  # refused before the compile, not after
    compile_options = {**(options or {}), "compiler": "aot_eager"}
    parsed = Options.parse(compile_options)
    # One knob: a sharded strategy's buckets are laid out by parallelize, ddp's when compiling.
    cap = compile_options.pop("bucket_cap_mb", None) if chosen.takes_bucket_cap else None
    meta = is_meta(model, example_inputs)
    on_meta = differentiable_on_meta() if meta else contextlib.nullcontext()
    with fake_world(world_size), assumed_device(spec), on_meta:  # ddp's buckets planned for ``device``, not this CPU
        torch.compiler.reset()
        try:
            work = chosen.prepare(copy.deepcopy(model), _positional(example_inputs), world_size, cap, parallelize)
            captures = _capture(work, example_inputs, compile_options, world_size, on_meta=meta)
        finally:
            torch.compiler.reset()
    if timed_on is not None:
        spec = with_kernel_times(spec, [g.graph for cap in captures for g in cap.graphs if g.label != "joint graph"], timed_on)
        spec = dataclasses.replace(spec, name=f"{spec.name} ({spec.kernel_times.describe()})")
    report = _report(type(model).__name__, work, captures, world_size, chosen.name, spec, parsed, optimizer, ranks_shown)
    artifact("explain_report", report.to_json, encoding="json")
    return report


def _check_gradients_reduced(name: str, strategy: str, params: Sequence[torch.Tensor], rows: Sequence[CollectiveRow]) -> None:
    """A data-parallel report whose backward graphs reduce no gradient is refused, not printed.

    Its step time and communication would be the compute alone, flat in N: the figures of
    a model no rank trains (the backward returned no gradient; see [Note: meta models lose
    their gradients under the python dispatcher] in ``meta.py`` for one way that happened).
    """
    trainable = sum(p.numel() for p in params if p.requires_grad)
    if not strategy_named(strategy).reduces_gradients or trainable == 0:
        return
    reduced = [r for r in rows if r.graph.split(": ")[-1].startswith("backward") and r.kind in ("all_reduce", "reduce_scatter")]
    if not reduced:
        raise InspectionError(
            f"dpar.explain: {name} has {trainable:,} trainable parameter elements, but under {strategy!r} "
            "its backward graphs reduce no gradient (no all_reduce or reduce_scatter): the captured "
            "backward returned no gradient for them, so a report would price a step that trains "
            "nothing. Check that the loss is differentiable in the parameters (requires_grad, no "
            "detach or no_grad around the model) and that the inputs' device traces gradients."
        )


def _report(
    name: str,
    model: torch.nn.Module,
    captures: Sequence[_Capture],
    world_size: int,
    strategy: str,
    spec: DeviceSpec,
    options: Options,
    optimizer: str,
    ranks_shown: int,
) -> Report:
    many = len(captures) > 1
    views, rows, buckets, step, pairs = [], [], [], [], []
    backward_steps, labels = [], []
    # A sub-group's ring is its own size, on its link (node-local when its ranks share a node).
    sub_groups = {name: (len(ranks), spec.link_among(ranks)) for cap in captures for name, ranks in cap.sub_groups.items()}
    for k, cap in enumerate(captures):
        prefix = f"graph {k}: " if many else ""
        for g in cap.graphs:
            views.append(GraphView(prefix + g.label, g.stages, g.graph))
        forward = cap.role("forward") or cap.role("inference")
        backward = cap.role("backward graph (sync)") or cap.role("backward graph")  # ddp: sync variant
        if forward is None:
            continue
        input_names, gradient_names = cap.flat_names(forward.graph)
        pairs.append((forward.graph, backward.graph if backward else None))
        labels.append({"forward": prefix + forward.label, "backward": prefix + backward.label if backward else ""})
        step.append((prefix + forward.label, forward.graph))
        if backward is not None:
            backward_steps.append((prefix + backward.label, backward.graph))
        for g in (forward, backward):
            if g is None:
                continue
            found = graph_buckets(g.graph, gradients=g is backward)
            first = len(buckets)
            nodes = {n.name: n for n in g.graph.graph.nodes}
            for b in found:
                names = input_names if b.kind == "all_gather" else gradient_names
                sharded = b.kind in ("all_gather", "reduce_scatter")  # parallelize's groups: no byte cap
                buckets.append(BucketRow(
                    len(buckets), prefix + g.label, dtype_name(b.dtype), tuple(names[i] for i in b.positions),
                    b.nbytes, None if sharded else options.bucket_cap_bytes, b.kind,
                    nodes[b.collective_node].meta.get(BUCKET_REASON, ""),
                ))
            for c in g.collectives:
                local = bucket_of(found, c.issue_node)
                nbytes = payload_bytes(nodes[c.issue_node])
                ranks, link = sub_groups.get(c.group, (world_size, spec.link_among(range(world_size))))
                rows.append(CollectiveRow(
                    prefix + g.label, c.kind, c.group, dtype_name(c.dtype), nbytes,
                    moved_bytes(c.kind, nbytes, ranks), None if local is None else first + local,
                    c.issue_node, c.wait_node, c.compute_between, link_time(c.kind, nbytes, ranks, link),
                ))
    params = list({id(p): p for p in model.parameters()}.values())
    if world_size > 1:  # one rank has nothing to reduce
        _check_gradients_reduced(name, strategy, params, rows)
    peak = step_peak(pairs, staged_collectives=spec.staged_collectives)
    memory = per_rank_memory(params, strategy_named(strategy), optimizer, peak, world_size)
    memory_timeline = tuple((labels[p.graph][p.phase], p.node, p.bytes) for p in peak.timeline)
    counted = graph_costs(pairs, spec)  # what the forwards hand their backwards, and the recomputation
    host = tensor_host_time([*params, *model.buffers()], spec)
    timeline = build_timeline(
        step + backward_steps[::-1], world_size, spec, ranks_shown=ranks_shown, sub_groups=sub_groups, host_seconds=host,
    )
    return Report(
        model=name, world_size=world_size, strategy=strategy, device=spec.name,
        options=tuple(sorted(dataclasses.asdict(options).items())),
        graphs=tuple(views), collectives=tuple(rows), buckets=tuple(buckets), memory=memory, timeline=timeline,
        scales_in_n=not strategy_named(strategy).local_state, saved_activations=counted.saved_bytes,
        recompute_time=counted.recompute_s, memory_timeline=memory_timeline, host_around_graphs=host,
    )
