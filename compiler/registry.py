"""A record of every graph dpar compiled in this process, for reports, tests and examples."""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch.fx as fx

from dpar.compiler.collectives import Collective


@dataclasses.dataclass(frozen=True)
class CompiledGraph:
    label: str  # "forward graph", "backward graph (sync)", ...
    graph: fx.GraphModule  # after dpar's passes, before the inner compiler
    collectives: tuple[Collective, ...]


compiled_graphs: list[CompiledGraph] = []


def record(label: str, gm: fx.GraphModule, found: list[Collective]) -> None:
    compiled_graphs.append(CompiledGraph(label, gm, tuple(found)))


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
