"""What ``dpar.explain`` returns: graphs per pass, collective and bucket tables, memory, timeline."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import torch
import torch.fx as fx

from dpar.inspect.memory import Memory
from dpar.inspect.timeline import Timeline
from dpar.compiler.registry import PassStage


@dataclasses.dataclass(frozen=True)
class GraphView:
    """One compiled graph: as captured and after every pass that ran on it."""

    label: str
    stages: tuple[PassStage, ...]
    graph: fx.GraphModule  # the final graph, for DOT

    @property
    def code(self) -> str | None:
        """The final graph's code; None in a report made under ``figures_only`` (the planner's count)."""
        return self.stages[-1].code

    def op_count_diffs(self) -> list[str]:
        """``"all_reduce_gradients: all_reduce: 0 -> 6"`` for every count a pass changed."""
        lines = []
        for before, after in zip(self.stages, self.stages[1:]):
            old = dict(before.op_counts)
            for kind, count in after.op_counts:
                if old.get(kind, 0) != count:
                    lines.append(f"{after.pass_name}: {kind}: {old.get(kind, 0)} -> {count}")
        return lines


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    graph: str
    kind: str
    group: str
    dtype: str
    bytes: int  # payload: the full buffer (gathered, or before the scatter)
    moved_bytes: float  # what one rank sends, by the ring model
    bucket: int | None
    issue_node: str
    wait_node: str
    compute_between: int
    seconds: float  # α-β time at the report's world size


@dataclasses.dataclass(frozen=True)
class BucketRow:
    index: int
    graph: str
    dtype: str
    parameters: tuple[str, ...]
    bytes: int
    cap_bytes: int | None  # None: grouped per block, not by size
    collective: str = "all_reduce"
    why: str = ""  # the bucket plan's reason it closed where it did (the all-reduce's node.meta)

    @property
    def fill(self) -> float | None:
        return None if self.cap_bytes is None else self.bytes / self.cap_bytes


@dataclasses.dataclass(frozen=True)
class Table:
    """A renderer-neutral table: the terminal, HTML and tests read the same rows."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.3f} MiB" if nbytes >= 2**20 else f"{nbytes:,.0f} B"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


@dataclasses.dataclass(frozen=True)
class Report:
    model: str
    world_size: int
    strategy: str
    device: str
    options: tuple[tuple[str, object], ...]
    graphs: tuple[GraphView, ...]
    collectives: tuple[CollectiveRow, ...]
    buckets: tuple[BucketRow, ...]
    memory: Memory
    timeline: Timeline
    scales_in_n: bool = True
    """False where collectives run over mesh dimensions of fixed size (hsdp, tp, 2-D): the step time
    and memory are the simulated mesh's, and the formulas in N do not extrapolate."""
    saved_activations: int = 0
    """Bytes the forward graphs hand their backwards (the tensors the backward reads, and the loss), by
    liveness: what ``dpar plan``'s search counts as activations. The peak (``memory.activations``) adds what
    lives only at its moment (gradients before their reduction, bucket buffers, the loss's backward)."""
    recompute_time: float = 0.0
    """Of ``timeline.compute_time``, the forward ops an activation policy runs again in the backward."""
    host_around_graphs: float = 0.0
    """Of ``timeline.compute_time``, the host work around the graphs (``costs.tensor_host_time``; see [Note: host
    work the graphs' kernels do not show]): 0 on a GPU preset."""
    memory_timeline: tuple[tuple[str, str, int], ...] = ()
    """(graph, node, bytes held above the state just after the node ran), over the step in the order it runs
    (forwards, then backwards in reverse): ``memory.step_peak`` is its highest point."""

    @property
    def title(self) -> str:
        return f"dpar report: {self.model}, {self.strategy} on {self.world_size} ranks ({self.device})"

    def op_count_diffs(self) -> dict[str, list[str]]:
        return {g.label: g.op_count_diffs() for g in self.graphs}

    def collective_table(self) -> Table:
        return Table(
            "Collectives",
            ("#", "graph", "kind", "group", "dtype", "bytes", "moved/rank", "bucket",
             "issued by", "waited by", "compute between", "time"),
            tuple(
                (str(i), c.graph, c.kind, c.group, c.dtype, f"{c.bytes:,}", f"{c.moved_bytes:,.0f}",
                 "-" if c.bucket is None else str(c.bucket), c.issue_node, c.wait_node,
                 str(c.compute_between), _time(c.seconds))
                for i, c in enumerate(self.collectives)
            ),
        )

    def bucket_table(self) -> Table:
        return Table(
            "Buckets",
            ("bucket", "graph", "dtype", "parameters", "bytes", "fill of cap", "collective", "why"),
            tuple(
                (str(b.index), b.graph, b.dtype, ", ".join(b.parameters), f"{b.bytes:,}",
                 "per block" if b.fill is None else f"{b.fill:.1%} of {_mib(b.cap_bytes)}", b.collective, b.why or "-")
                for b in self.buckets
            ),
        )

    def memory_table(self) -> Table:
        m = self.memory
        rows = [
            ("parameters", m.parameters), ("gradients", m.gradients),
            ("optimizer state", m.optimizer), ("gathered parameters (at the peak)", m.gathered),
            ("activations (at the peak, estimate)", m.activations),
            ("total", m.total),
            ("  activations saved for the backward", self.saved_activations),
        ]
        return Table(
            f"Memory per rank (N = {self.world_size})",
            ("what", "bytes", "size"),
            tuple((name, f"{v:,}", _mib(v)) for name, v in rows),
        )

    def memory_timeline_table(self) -> Table:
        """Per graph, in the order the step runs them: the bytes above the state where it starts, at its
        highest (and after which node), where it ends (the whole timeline: ``--trace``'s memory counter)."""
        rows = []
        for graph in dict.fromkeys(g for g, _, _ in self.memory_timeline):
            points = [(node, nbytes) for g, node, nbytes in self.memory_timeline if g == graph]
            node, highest = max(points, key=lambda p: p[1])
            rows.append((graph, _mib(points[0][1]), f"{_mib(highest)} after {node}", _mib(points[-1][1])))
        return Table("Memory timeline (above the state a rank holds between steps)",
                     ("graph", "first node", "highest", "last node"), tuple(rows))

    def timeline_table(self) -> Table:
        t = self.timeline
        rows = [
            ("step time", _time(t.step_time)), ("compute", _time(t.compute_time)),
            ("  of which recomputation", _time(self.recompute_time)), ("communication", _time(t.comm_time)), ("exposed communication", _time(t.exposed_comm)),
            ("overlap", f"{t.overlap:.1%}"),
        ]
        if self.host_around_graphs:
            rows.insert(3, ("  of which host work around the graphs", _time(self.host_around_graphs)))
        return Table(f"Simulated step ({t.device}, N = {t.world_size})", ("", "value"), tuple(rows))

    def scaling_table(self, sizes: Sequence[int] = (2, 8, 64, 512, 1024)) -> Table:
        sizes = sorted({*sizes, self.world_size})
        return Table(
            "Step time in N",
            ("N", "step time", "memory per rank"),
            tuple((str(n), _time(s), _mib(self.memory.total_at(n))) for n, s in self.timeline.scaling(sizes)),
        )

    def tables(self) -> list[Table]:
        tables = [self.collective_table(), self.bucket_table(), self.memory_table(), self.memory_timeline_table(),
                  self.timeline_table()]
        return tables + [self.scaling_table()] if self.scales_in_n else tables

    def fixed_mesh_note(self) -> str:
        """What replaces the formulas in N where ``scales_in_n`` is False."""
        return f"{self.strategy}: sub-groups of fixed size; the figures hold for N = {self.world_size} only"

    def to_json(self) -> str:
        """The tables and formulas as JSON (the structured-trace artifact)."""
        return json.dumps({
            "title": self.title,
            "op_count_diffs": self.op_count_diffs(),
            "tables": [dataclasses.asdict(t) for t in self.tables()],
            "step_time_formula": str(self.timeline.step_time_expr),
            "memory_formula": str(self.memory.symbolic),
        })


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
