"""The ``dpar`` command: ``dpar inspect TARGET --world-size N --strategy S`` and ``dpar plan TARGET --mesh-shape 2,4``."""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_FUNCTION = "default"
"""An example file named without ``:fn`` is loaded through its ``default()``."""


def load_target(target: str) -> Callable[[], tuple[Any, Any]]:
    """``path/to/file.py:fn``, ``path/to/file.py`` (its ``default``) or ``package.module:fn``."""
    spec, _, fn = target.partition(":")
    fn = fn or DEFAULT_FUNCTION
    if spec.endswith(".py") or Path(spec).is_file():
        path = Path(spec).resolve()
        if not path.is_file():
            raise SystemExit(f"dpar inspect: no such file {spec!r}")
        loader = importlib.util.spec_from_file_location(f"dpar_target_{path.stem}", path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[loader.name] = module  # dataclasses and pickling look the module up
        sys.path.insert(0, str(path.parent))  # the example may import its neighbours
        try:
            loader.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.parent))
    else:
        module = importlib.import_module(spec)
    if not hasattr(module, fn):
        raise SystemExit(f"dpar inspect: {spec!r} has no function {fn!r}; TARGET is FILE.py:fn or module:fn")
    return getattr(module, fn)


def _inspect(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dpar.core.errors import OptionsError
    from dpar.explaining import explain
    from dpar.inspect.render_text import print_report

    if args.strategy == "pipeline":
        return _inspect_pipeline(args)
    if args.world_size is None:
        raise SystemExit(f"dpar inspect: --strategy {args.strategy} needs --world-size N")
    model, example_inputs = load_target(args.target)()
    options = {"sink_waits": not args.no_sink_waits}
    if args.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = args.bucket_cap_mb
    policy = args.activation_checkpointing
    console = Console(width=None if sys.stdout.isatty() else 160)  # pipes and CI logs: wide tables
    placement = {"same_batch_in_cp_group": True} if args.same_batch_in_cp_group else {}
    if args.attention_exchange is not None:
        placement["attention_exchange"] = args.attention_exchange
    try:
        report = explain(
            model, example_inputs, world_size=args.world_size, strategy=args.strategy,
            options=options, device=args.device, optimizer=args.optimizer, profile_kernels=args.profile_kernels,
            **({"activation_checkpointing": policy} if policy not in (None, "keep") else {}), **placement,
        )
    except OptionsError as error:
        console.print(f"dpar inspect: {error}", markup=False, highlight=False)
        return 2
    print_report(report, console, show_code=args.code)
    if policy not in (None, "keep"):
        from dpar.inspect.activations import activation_rows, print_activations

        keep = explain(model, example_inputs, world_size=args.world_size, strategy=args.strategy, options=options,
                       device=args.device, optimizer=args.optimizer, profile_kernels=args.profile_kernels, **placement)
        print_activations(activation_rows(policy, report, keep), console)
    if args.trace:
        console.print(f"trace: {report.timeline.save(args.trace, report.memory_timeline)} (open in ui.perfetto.dev)")
    if args.png:
        console.print(f"timeline plot: {report.timeline.plot(args.png)}")
    if args.dot:
        from dpar.inspect.render_dot import write_dot

        for path in write_dot(report, Path(args.dot)):
            console.print(f"graph: {path}")
    if args.html:
        from dpar.inspect.render_html import write_html

        console.print(f"html: {write_html(report, Path(args.html))}")
    return 0


def _inspect_pipeline(args: argparse.Namespace) -> int:
    """``--strategy pipeline``: the stage split, the schedule and its simulated timeline."""
    from rich.console import Console

    from dpar.inspect.pipeline import explain_pipeline, print_pipeline_report
    from dpar.core.errors import OptionsError
    from dpar.pipelining import pipeline
    from dpar.placement import activation_policy

    unused = [flag for flag, given in (("--html", args.html), ("--dot", args.dot), ("--png", args.png),
                                       ("--code", args.code), ("--bucket-cap-mb", args.bucket_cap_mb)) if given]
    if unused or args.stages is None:
        raise SystemExit(f"dpar inspect --strategy pipeline: needs --stages S (and takes --micro-batches, --schedule, "
                         f"--tp, --loss, --trace){'; drop ' + ', '.join(unused) if unused else ''}")
    model, example_inputs = load_target(args.target)()
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        report = explain_pipeline(
            model, example_inputs, stages=args.stages, micro_batches=args.micro_batches or args.stages,
            schedule=args.schedule, world_size=args.world_size, virtual_stages=args.virtual_stages,
            loss_fn=load_target(args.loss) if args.loss else None, device=args.device, optimizer=args.optimizer,
            tensor_parallel=args.tp, pipeline=pipeline, profile_kernels=args.profile_kernels,
            activations=activation_policy(model, args.activation_checkpointing),
        )
    except OptionsError as error:
        console.print(f"dpar inspect: {error}", markup=False, highlight=False)
        return 2
    print_pipeline_report(report, console)
    if args.trace:
        console.print(f"trace: {report.save(args.trace)} (open in ui.perfetto.dev)")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dpar.planner.plan import render
    from dpar.planning import global_batch, plan
    from dpar.core.errors import OptionsError

    model, example_inputs = load_target(args.target)()
    if args.per_rank:  # as strategy="auto" takes them: one rank's slice, every rank fed different rows
        example_inputs = global_batch(example_inputs, math.prod(args.mesh_shape))
    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.pipeline:
        return _plan_pipeline(args, model, example_inputs, console)
    try:
        result = plan(
            model, example_inputs, mesh_shape=args.mesh_shape, memory_budget_gb=args.memory_budget_gb,
            mesh_dim_names=args.mesh_dim_names, device=args.device, on_graphs=not args.op_graph,
            pipelines=False if args.placements_only else (True if args.with_pipelines else None),
        )
    except OptionsError as error:
        console.print(f"dpar plan: {error}")
        return 2
    render(result, console)
    if args.json:
        Path(args.json).write_text(result.to_json())
        console.print(f"json: {args.json}")
    return 0


def _plan_pipeline(args: argparse.Namespace, model: Any, example_inputs: Any, console: Any) -> int:
    """``dpar plan --pipeline``: the pp x tp x dp layout for the mesh's ranks under the budget."""
    from dpar.inspect.pipeline import block_collectives
    from dpar.pipelining import pipeline
    from dpar.planner.pipeline import DP_STRATEGIES, plan_pipeline
    from dpar.core.errors import OptionsError

    try:
        result = plan_pipeline(
            model, example_inputs, world_size=math.prod(args.mesh_shape), memory_budget_gb=args.memory_budget_gb,
            micro_batch_rows=args.micro_batch_rows, schedule=args.schedule,
            loss_fn=load_target(args.loss) if args.loss else None, device=args.device, tp_max=args.tp_max,
            dp_strategies=(args.dp_strategy,) if args.dp_strategy else DP_STRATEGIES,
            read_tp_collectives=functools.partial(block_collectives, model, pipeline=pipeline),
        )
    except OptionsError as error:
        console.print(f"dpar plan: {error}", markup=False, highlight=False)
        return 2
    console.print(str(result), markup=False, highlight=False, soft_wrap=True)  # a table: one line a candidate
    return 0


def _ints(text: str) -> tuple[int, ...]:
    """``8`` or ``2,4``."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 8 or 2,4, not {text!r}") from None


def parser() -> argparse.ArgumentParser:
    from dpar.compiler.pipeline_parallel.schedules import SCHEDULES
    from dpar.planner.pipeline import DP_STRATEGIES, PLANNED_SCHEDULES
    from dpar.compiler.costs import PRESETS
    from dpar.compiler.memory import OPTIMIZER_STATES
    from dpar.core.plan import ATTENTION_EXCHANGES
    from dpar.inspect.strategies import STRATEGIES

    top = argparse.ArgumentParser(prog="dpar", description="dpar: graph-level data parallelism for torch.compile")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="simulate N ranks in this process and report what dpar does")
    p.add_argument("target", help="FILE.py[:fn] or package.module:fn; fn() returns (model, example_inputs)")
    p.add_argument("--world-size", "-n", type=int, default=None, help="required, except for --strategy pipeline")
    p.add_argument("--strategy", default="ddp", choices=sorted([*STRATEGIES, "pipeline"]))
    p.add_argument("--device", default="h100", choices=sorted(PRESETS), help="cost-model preset")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--no-sink-waits", action="store_true", help="keep each wait next to its collective")
    p.add_argument("--activation-checkpointing", default=None, choices=("keep", "selective", "full"),
                   help="every block's policy, as dpar.parallelize(activation_checkpointing=...) takes it")
    p.add_argument("--same-batch-in-cp-group", action="store_true", help="cp strategies: every rank of a cp group "
                   "fed the same rows, as dpar.parallelize(same_batch_in_cp_group=True): each holds its chunks of one batch")
    p.add_argument("--attention-exchange", default=None, choices=ATTENTION_EXCHANGES, help="cp strategies: how "
                   "attention reads the other ranks' tokens, as dpar.parallelize(attention_exchange=...); default: "
                   "per attention, the cheaper by bytes")
    p.add_argument("--profile-kernels", action="store_true", help="time every kernel of the graphs on this machine "
                   "(CUDA if present, else the CPU) and price them so, not by the roofline; --device must be this machine's")
    p.add_argument("--code", action="store_true", help="print every graph after every pass")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    p.add_argument("--dot", metavar="DIR", help="write Graphviz DOT (and SVG for small graphs) per graph")
    p.add_argument("--trace", metavar="FILE", help="write the simulated timeline as Perfetto JSON")
    p.add_argument("--png", metavar="FILE", help="write the simulated timeline as a PNG plot")
    g = p.add_argument_group("--strategy pipeline (world size: the pipeline's ranks unless -n says more)")
    g.add_argument("--stages", type=int, help="pipeline stages")
    g.add_argument("--micro-batches", type=int, help="micro-batches per step (default: the stages)")
    g.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    g.add_argument("--virtual-stages", type=int, default=None, help="stages per rank (interleaved_1f1b, default 2)")
    g.add_argument("--tp", type=int, default=1, help="split each stage over this many tensor-parallel ranks (a "
                   "('dp', 'pp', 'tp') mesh); -n counts them")
    g.add_argument("--loss", metavar="FILE.py:fn", help="loss_fn(output, target), the target being the last input; "
                   "default: cross-entropy of the output as logits against targets shaped like the first input")
    p.set_defaults(run=_inspect)
    p = sub.add_parser("plan", help="choose data / tensor parallel placements per parameter (the planner's ILP)")
    p.add_argument("target", help="FILE.py[:fn] or package.module:fn; fn() returns (model, example_inputs), "
                   "example_inputs the global batch (all ranks' rows) unless --per-rank")
    p.add_argument("--per-rank", action="store_true",
                   help="example_inputs are one rank's slice (as strategy='auto' takes them): plan for mesh-size slices")
    p.add_argument("--mesh-shape", type=_ints, required=True, help="ranks per mesh dimension: 8, or 2,4")
    p.add_argument("--memory-budget-gb", type=float, default=None, help="per rank; default: the device's memory (none for cpu). The plan recomputes "
                   "activations (selective or full checkpointing) when that is the fastest way to fit")
    p.add_argument("--device", default="h100", choices=sorted(PRESETS), help="cost-model preset, as dpar inspect's")
    p.add_argument("--mesh-dim-names", type=lambda t: tuple(t.split(",")), default=None,
                   help="fix each dimension's role (dp, tp, ep, cp) instead of letting the solver choose: dp,tp")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON (Plan.from_json reads it)")
    p.add_argument("--op-graph", action="store_true", help="report the search's op-graph figures; default: the chosen "
                   "plan's compute and activations counted on its compiled graphs, as dpar inspect counts them")
    searched = p.add_mutually_exclusive_group()
    searched.add_argument("--placements-only", action="store_true", help="search placements alone; default: pipelines "
                          "too on a GPU preset, and the plan is the faster answer (run by dpar.pipeline(plan=...))")
    searched.add_argument("--with-pipelines", action="store_true",
                          help="search pipelines too on every device, the cpu preset included")
    g = p.add_argument_group("--pipeline: the pipeline search alone, every pp x tp x dp layout it priced")
    g.add_argument("--pipeline", action="store_true", help="price every pp x tp x dp layout of the mesh's ranks")
    g.add_argument("--schedule", default="1f1b", choices=PLANNED_SCHEDULES)
    g.add_argument("--tp-max", type=int, default=8, help="largest tensor-parallel degree searched (a power of two); "
                   "1: pipeline and data parallelism only, what dpar.pipeline runs today")
    g.add_argument("--dp-strategy", default=None, choices=DP_STRATEGIES, help="across pipelines; default: search both")
    g.add_argument("--micro-batch-rows", type=int, default=None, help="default: searched from global rows / ranks down")
    g.add_argument("--loss", metavar="FILE.py:fn", help="loss_fn(output, target), the target the last input; "
                   "default: next-token cross-entropy against targets shaped like the first input")
    p.set_defaults(run=_plan)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
