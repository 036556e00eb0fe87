"""Graphviz DOT of the compiled graphs, collectives highlighted; SVG where Graphviz can draw it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import torch.fx as fx

from dpar.compiler.collectives import COLLECTIVE_KINDS, WAIT

if TYPE_CHECKING:
    from dpar.inspect.report import Report

SVG_MAX_NODES = 400
"""Above this, dot takes long and the picture is unreadable: the .dot file is still written."""

_STYLE = {
    "collective": 'style=filled fillcolor="#f4a261"',
    "wait": 'style=filled fillcolor="#ffe08a"',
    "placeholder": 'style=filled fillcolor="#e0e0e0"',
    "output": 'style=filled fillcolor="#e0e0e0"',
    "compute": "",
}


def _kind(node: fx.Node) -> str:
    if node.target in COLLECTIVE_KINDS:
        return "collective"
    if node.target is WAIT:
        return "wait"
    return node.op if node.op in ("placeholder", "output") else "compute"


def _quote(*lines: str) -> str:
    """A DOT string literal; several lines are joined by DOT's own line break."""
    escaped = (line.replace("\\", "\\\\").replace('"', '\\"') for line in lines)
    return '"' + "\\n".join(escaped) + '"'


def to_dot(gm: fx.GraphModule, title: str) -> str:
    lines = [f"digraph {_quote(title)} {{", "  rankdir=TB; node [shape=box fontname=monospace fontsize=10];",
             f"  label={_quote(title)}; labelloc=t;"]
    for node in gm.graph.nodes:
        op = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else node.op
        lines.append(f"  {_quote(node.name)} [label={_quote(node.name, op)} {_STYLE[_kind(node)]}];")
        for arg in node.all_input_nodes:
            lines.append(f"  {_quote(arg.name)} -> {_quote(node.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def svg(gm: fx.GraphModule, title: str) -> str | None:
    """The graph drawn by Graphviz, or None when it is missing or the graph is too large."""
    if shutil.which("dot") is None or len(gm.graph.nodes) > SVG_MAX_NODES:
        return None
    done = subprocess.run(["dot", "-Tsvg"], input=to_dot(gm, title), capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else None


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")


def write_dot(report: Report, directory: Path) -> list[Path]:
    """One ``.dot`` per final graph, and an ``.svg`` beside it for the small ones."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for view in report.graphs:
        path = directory / f"{slug(view.label)}.dot"
        path.write_text(to_dot(view.graph, view.label))
        written.append(path)
        drawn = svg(view.graph, view.label)
        if drawn is not None:
            written.append(path.with_suffix(".svg"))
            written[-1].write_text(drawn)
    return written
