"""The simulated timeline of one training step: from compiled graphs to per-rank streams."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import sympy
import torch.fx as fx

from dpar.compiler.collectives import COLLECTIVE_KINDS, WAIT
from dpar.compiler.costs import ALPHA, B, BETA, N, DeviceSpec, comm_time_expr, node_cost, payload_bytes
from dpar.inspect.simulate import Event, Op, OpKind, PathTime, simulate


def step_program(
    graphs: Sequence[tuple[str, fx.GraphModule]], spec: DeviceSpec,
    sub_groups: Mapping[str, tuple[int, tuple[float, float]]] | None = None,
) -> list[Op]:
    """The ops one rank runs in a step, graph after graph; comm durations are sympy in N.

    A collective over a sub-group of fixed size (a tensor-parallel or 2-D mesh dimension, in
    ``sub_groups``: its size and (α, β) link) costs that size's ring on that link, a number, not N's."""
    program: list[Op] = []
    issued: dict[fx.Node, int] = {}
    for label, gm in graphs:
        for node in gm.graph.nodes:
            kind = COLLECTIVE_KINDS.get(node.target)
            if kind is not None:
                group = (sub_groups or {}).get(str(node.args[-1]))
                alpha, beta = spec.world_link() if group is None else group[1]
                seconds = comm_time_expr(kind).subs({B: payload_bytes(node), ALPHA: alpha, BETA: beta})
                seconds = seconds if group is None else seconds.subs(N, group[0])
                if spec.collective_host_seconds > 0:  # the calling thread's part, before the collective starts
                    program.append(Op(OpKind.COMPUTE, f"{node.name} (host)", spec.collective_host_seconds, graph=label))
                issued[node] = len(issued)
                program.append(Op(OpKind.ISSUE, node.name, seconds, issued[node], label, str(node.args[-1])))
            elif node.target is WAIT:
                program.append(Op(OpKind.WAIT, node.name, collective=issued[node.args[0]], graph=label))
            elif node.op == "call_function":
                seconds = node_cost(node, spec).seconds
                if seconds > 0:
                    program.append(Op(OpKind.COMPUTE, node.name, seconds, graph=label))
    return program


def program_at(program: Sequence[Op], world_size: int, *, tracked: bool = False) -> list[Op]:
    """The program in seconds at ``world_size``; ``tracked`` keeps each comm's formula too."""
    values = {e: float(e.subs(N, world_size)) for e in {op.seconds for op in program if op.kind is OpKind.ISSUE}}
    ops = []
    for op in program:
        if op.kind is OpKind.ISSUE:
            v = values[op.seconds]
            op = dataclasses.replace(op, seconds=PathTime(v, 0.0, op.seconds) if tracked else v)
        elif op.kind is OpKind.COMPUTE and tracked:
            op = dataclasses.replace(op, seconds=PathTime(op.seconds, op.seconds))
        ops.append(op)
    return ops


@dataclasses.dataclass(frozen=True)
class Timeline:
    """One simulated step at ``world_size`` ranks, of which ``ranks_shown`` have events.

    Under data parallelism every rank runs the same program, so a few ranks show
    what all of them do. ``step_time_expr`` is the critical path's closed form
    in N: exact at ``world_size`` and wherever the same path stays critical;
    ``step_time_at`` re-simulates at any N.
    """

    world_size: int
    ranks_shown: int
    device: str
    events: tuple[Event, ...]
    step_time: float
    compute_time: float
    comm_time: float
    step_time_expr: sympy.Expr
    program: tuple[Op, ...] = dataclasses.field(repr=False, default=())

    @property
    def exposed_comm(self) -> float:
        """Time the compute stream sits blocked on a wait (or the step outlasts it)."""
        return max(0.0, self.step_time - self.compute_time)

    @property
    def overlap(self) -> float:
        """Share of communication hidden behind compute, 0..1 (1 when there is none)."""
        if self.comm_time <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.exposed_comm / self.comm_time))

    def step_time_at(self, world_size: int) -> float:
        return float(simulate({0: program_at(self.program, world_size)}, record=False).step_time)

    def scaling(self, sizes: Sequence[int] = (2, 8, 64, 512, 1024)) -> list[tuple[int, float]]:
        return [(n, self.step_time_at(n)) for n in sizes]

    def save(self, path: str | Path, memory: Sequence[tuple[str, str, int]] = ()) -> Path:
        """Chrome/Perfetto trace JSON: one process per rank, compute and comm threads; ``memory``
        (``Report.memory_timeline``) as a counter on rank 0."""
        from dpar.inspect.trace import write_trace

        return write_trace(self, Path(path), memory)

    def plot(self, path: str | Path) -> Path:
        from dpar.inspect.render_plot import plot_timeline

        return plot_timeline(self, Path(path))


def build_timeline(
    graphs: Sequence[tuple[str, fx.GraphModule]],
    world_size: int,
    spec: DeviceSpec,
    *,
    ranks_shown: int = 4,
    sub_groups: Mapping[str, tuple[int, tuple[float, float]]] | None = None,
    host_seconds: float = 0.0,
) -> Timeline:
    """``host_seconds``: the step's host work around its graphs (``costs.tensor_host_time``), run before the first."""
    program = step_program(graphs, spec, sub_groups)
    if host_seconds > 0:
        program.insert(0, Op(OpKind.COMPUTE, "host work around the graphs", host_seconds, graph=graphs[0][0] if graphs else ""))
    shown = max(1, min(world_size, ranks_shown))
    tracked = program_at(program, world_size, tracked=True)
    schedule = simulate({r: tracked for r in range(shown)})
    step = schedule.step_time
    assert isinstance(step, PathTime)
    return Timeline(
        world_size=world_size,
        ranks_shown=shown,
        device=spec.name,
        events=schedule.events,
        step_time=step.value,
        compute_time=sum(op.seconds.value for op in tracked if op.kind is OpKind.COMPUTE),
        comm_time=sum(op.seconds.value for op in tracked if op.kind is OpKind.ISSUE),
        step_time_expr=sympy.simplify(step.expr),
        program=tuple(program),
    )
