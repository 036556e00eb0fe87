"""``dpar inspect --activation-checkpointing POLICY``: what the policy saves and recomputes, next to keep.

Read off the forward and backward graphs the report already holds: the bytes the forward saves for
the backward (its outputs that it computed, not its inputs), the ops of each block the backward
computes again (``compiler/passes/recompute.recomputed_per_block``), and the report's activation
figure at the peak, with the policy and without it (``keep``).
"""

from __future__ import annotations

import torch.fx as fx
from rich.console import Console
from rich.table import Table

from dpar.compiler.passes.recompute import recomputed_per_block, saved_bytes
from dpar.inspect.report import Report


def _graph(report: Report, role: str) -> fx.GraphModule | None:
    view = next((v for v in report.graphs if v.label.split(": ")[-1].startswith(role)), None)
    return None if view is None else view.graph


def activation_rows(policy: str, report: Report, keep: Report) -> dict[str, object]:
    """The figures ``print_activations`` shows: saved bytes and activations at the peak with and without the
    policy, and the recomputed ops per block."""
    forward, backward = _graph(report, "forward"), _graph(report, "backward")
    kept = _graph(keep, "forward")
    return {
        "policy": policy,
        "saved_bytes": (saved_bytes(kept) if kept is not None else 0, saved_bytes(forward) if forward is not None else 0),
        "peak_activations": (keep.memory.activations, report.memory.activations),
        "recomputed": recomputed_per_block(forward, backward) if forward is not None and backward is not None else {},
    }


def print_activations(rows: dict[str, object], console: Console) -> None:
    table = Table(title=f"activation checkpointing: {rows['policy']} (against keep)")
    table.add_column("")
    table.add_column("keep", justify="right")
    table.add_column(str(rows["policy"]), justify="right")
    for label, (before, after) in (("bytes the forward saves", rows["saved_bytes"]),
                                   ("activations at the peak (estimate)", rows["peak_activations"])):
        table.add_row(label, f"{before:,}", f"{after:,}")
    console.print(table)
    recomputed = rows["recomputed"]
    if recomputed:
        blocks = Table(title="ops each block computes again in the backward")
        blocks.add_column("block")
        blocks.add_column("recomputed ops", justify="right")
        for block, count in sorted(recomputed.items()):
            blocks.add_row(block, str(count))
        console.print(blocks)
    else:
        console.print("no block is recomputed")
