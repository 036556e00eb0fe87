"""A self-contained HTML page of a report: tables, timeline picture, graphs with collectives marked."""

from __future__ import annotations

import base64
import html
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from dpar.inspect.render_dot import slug, svg

if TYPE_CHECKING:
    from dpar.inspect.report import GraphView, Report, Table

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
pre { background: #f8f8f8; padding: 0.8em; font-size: 12px; overflow-x: auto; }
mark.collective { background: #f4a261; }
mark.wait { background: #ffe08a; }
img.timeline { max-width: 100%; border: 1px solid #ddd; }
code.formula { font-size: 13px; }
"""


def _formulas(report: Report) -> str:
    if not report.scales_in_n:
        return f"<p>{html.escape(report.fixed_mesh_note())}</p>"
    return f"""<p>step time(N) = <code class="formula">{html.escape(str(report.timeline.step_time_expr))}</code> s<br>
memory per rank(N) = <code class="formula">{html.escape(str(report.memory.symbolic))}</code>
= {report.memory.formula} bytes</p>"""


def _table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table.headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in table.rows
    )
    return f'<h2 id="{slug(table.title).lower()}">{html.escape(table.title)}</h2>\n<table><tr>{head}</tr>{body}</table>'


def _code(text: str) -> str:
    """Graph code with the lines that issue or wait on a collective marked."""
    lines = []
    for line in html.escape(text).splitlines():
        if "_c10d_functional.wait_tensor" in line:
            line = f'<mark class="wait">{line}</mark>'
        elif "_c10d_functional." in line:
            line = f'<mark class="collective">{line}</mark>'
        lines.append(line)
    return "<pre>" + "\n".join(lines) + "</pre>"


def _graph(view: GraphView) -> str:
    diffs = view.op_count_diffs()
    parts = [f"<h3>{html.escape(view.label)}</h3>",
             "<p>" + html.escape("; ".join(diffs) if diffs else "no collective added") + "</p>"]
    drawn = svg(view.graph, view.label)
    if drawn is not None:
        parts.append(f"<details><summary>picture</summary>{drawn[drawn.find('<svg'):]}</details>")
    for stage in view.stages:
        parts.append(f"<details><summary>after {html.escape(stage.pass_name)}</summary>{_code(stage.code)}</details>")
    return "\n".join(parts)


def _timeline_png(report: Report) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        png = report.timeline.plot(Path(tmp) / "timeline.png").read_bytes()
    return base64.b64encode(png).decode()


def render_html(report: Report) -> str:
    options = ", ".join(f"{k}={v}" for k, v in report.options)
    title = html.escape(report.title)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{_CSS}</style></head>
<body>
<h1>{title}</h1>
<p>options: {html.escape(options)}</p>
<h2>Simulated timeline</h2>
<img class="timeline" alt="simulated timeline" src="data:image/png;base64,{_timeline_png(report)}">
{_formulas(report)}
{"".join(_table(t) for t in report.tables())}
<h2>Graphs after each pass</h2>
{"".join(_graph(g) for g in report.graphs)}
</body></html>
"""


def write_html(report: Report, path: Path) -> Path:
    path.write_text(render_html(report), encoding="utf-8")
    return path
