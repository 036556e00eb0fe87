"""The graphs dpar compiles, handed to whoever asked for them: reports, tests, benchmarks.

Nothing is kept unless a caller is recording: a long job that recompiles holds no
graph module it no longer runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator, Sequence

import torch.fx as fx

from dpar.compiler.collectives import Collective, op_counts
from dpar.compiler.logs import graph_code_logged, log_collectives

STAGES_KEY = "dpar_pass_stages"
"""``GraphModule.meta`` key under which ``run_passes`` leaves the graph after each pass."""


@dataclasses.dataclass(frozen=True)
class PassStage:
    """A graph as one pass left it: its collective counts and, where someone reads it, its readable code."""

    pass_name: str  # "captured" for the graph AOTAutograd handed over
    code: str | None  # None where nothing asked for it (``code_wanted``)
    op_counts: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, pass_name: str, gm: fx.GraphModule) -> PassStage:
        return cls(pass_name, gm.code if code_wanted() else None, tuple(op_counts(gm).items()))


@dataclasses.dataclass(frozen=True)
class CompiledGraph:
    label: str  # "forward graph", "backward graph (sync)", ...
    graph: fx.GraphModule  # after dpar's passes, before the inner compiler
    collectives: tuple[Collective, ...]
    stages: tuple[PassStage, ...] = ()  # the captured graph, then one per pass that ran


_recorders: list[list[CompiledGraph]] = []
_figures_only = 0  # how many ``figures_only`` blocks are open


def code_wanted() -> bool:
    """Whether each pass's graph is written out as Python: for a recording caller (``explain``, tests) outside
    ``figures_only``, or a log that prints graphs. Writing it costs about what the pass does on a large graph."""
    return (bool(_recorders) and not _figures_only) or graph_code_logged()


def counting_figures() -> bool:
    """Whether a ``figures_only`` block is open: what is compiled is read for its figures, and never runs a backward
    nor serves a second model."""
    return bool(_figures_only)


@contextlib.contextmanager
def figures_only() -> Iterator[None]:
    """Compiles inside the block record no pass's code, only their collectives, and lower no backward: for a caller
    that reads figures alone and runs the forward once, on meta (the planner's count on graphs; a tensor-parallel copy
    of Llama-3-70B's blocks wrote about a second of code a pass, and half a second to lower its backward)."""
    global _figures_only
    _figures_only += 1
    try:
        yield
    finally:
        _figures_only -= 1


@contextlib.contextmanager
def recording() -> Iterator[list[CompiledGraph]]:
    """The graphs dpar compiles inside the block, in order, in a list the caller owns.

    Only the innermost block records, so ``explain`` (which records its own
    simulated compile) adds nothing to a caller's list.
    """
    graphs: list[CompiledGraph] = []
    _recorders.append(graphs)
    try:
        yield graphs
    finally:
        _recorders.remove(graphs)


def record(label: str, gm: fx.GraphModule, found: list[Collective]) -> None:
    if _recorders:
        _recorders[-1].append(CompiledGraph(label, gm, tuple(found), tuple(gm.meta.get(STAGES_KEY, ()))))
    log_collectives(label, found)


def communication_per_step(graphs: Sequence[CompiledGraph]) -> dict[str, dict[str, int]]:
    """Collectives and bytes one synchronising training step issues, by kind.

    Sums the forward and synchronising backward graphs among ``graphs``; a model
    that recompiled counts every version, so record a steady state.
    """
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for compiled in graphs:
        if compiled.label.startswith(("inference", "joint")) or "no_sync" in compiled.label or "accumulated" in compiled.label:
            continue
        for c in compiled.collectives:
            counts[c.kind] += 1
            nbytes[c.kind] += max(c.bytes, 0)
    return {kind: {"count": counts[kind], "bytes": nbytes[kind]} for kind in sorted(counts)}
