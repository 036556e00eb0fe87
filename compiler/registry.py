"""A record of every graph dpar compiled in this process, for reports, tests and examples."""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch.fx as fx

from dpar.compiler.collectives import Collective, op_counts
from dpar.compiler.inspect.logs import log_collectives

STAGES_KEY = "dpar_pass_stages"
"""``GraphModule.meta`` key under which ``run_passes`` leaves the graph after each pass."""


@dataclasses.dataclass(frozen=True)
class PassStage:
    """A graph as one pass left it: readable code and its collective counts."""

    pass_name: str  # "captured" for the graph AOTAutograd handed over
    code: str
    op_counts: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, pass_name: str, gm: fx.GraphModule) -> PassStage:
        return cls(pass_name, gm.code, tuple(op_counts(gm).items()))


@dataclasses.dataclass(frozen=True)
class CompiledGraph:
    label: str  # "forward graph", "backward graph (sync)", ...
    graph: fx.GraphModule  # after dpar's passes, before the inner compiler
    collectives: tuple[Collective, ...]
    stages: tuple[PassStage, ...] = ()  # the captured graph, then one per pass that ran


compiled_graphs: list[CompiledGraph] = []


def record(label: str, gm: fx.GraphModule, found: list[Collective]) -> None:
    compiled_graphs.append(CompiledGraph(label, gm, tuple(found), tuple(gm.meta.get(STAGES_KEY, ()))))
    log_collectives(label, found)


def communication_per_step() -> dict[str, dict[str, int]]:
    """Collectives and bytes one synchronising training step issues, by kind.

    Sums the forward and synchronising backward graphs compiled so far; a model
    that recompiled counts every version, so read it after a steady state.
    """
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for compiled in compiled_graphs:
        if compiled.label.startswith("inference") or "no_sync" in compiled.label or "accumulated" in compiled.label:
            continue
        for c in compiled.collectives:
            counts[c.kind] += 1
            nbytes[c.kind] += max(c.bytes, 0)
    return {kind: {"count": counts[kind], "bytes": nbytes[kind]} for kind in sorted(counts)}
