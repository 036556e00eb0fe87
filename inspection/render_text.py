"""The report in a terminal: rich tables, op-count diffs and the step-time formula."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from dpar.inspect.report import Report, Table


def _rich_table(table: Table):
    from rich.table import Table as RichTable

    out = RichTable(title=table.title, title_justify="left", header_style="bold")
    for header in table.headers:
        numeric = header in ("bytes", "moved/rank", "compute between", "time", "step time", "size")
        if header == "parameters":  # long lists: one line each, cut; the HTML report has them all
            out.add_column(header, no_wrap=True, overflow="ellipsis", max_width=48)
        else:
            out.add_column(header, justify="right" if numeric else "left", overflow="fold")
    for row in table.rows:
        out.add_row(*row)
    return out


def print_report(report: Report, console: Console | None = None, *, show_code: bool = False) -> None:
    from rich.console import Console

    console = console or Console()
    console.rule(report.title)
    for label, diffs in report.op_count_diffs().items():
        console.print(f"[bold]{label}[/bold]: " + ("; ".join(diffs) if diffs else "no collective added"))
        if show_code:
            graph = next(g for g in report.graphs if g.label == label)
            for stage in graph.stages:
                console.print(f"[dim]# after {stage.pass_name}[/dim]")
                console.print(stage.code, markup=False, highlight=False)
    for table in report.tables():
        console.print(_rich_table(table))
    if not report.scales_in_n:
        console.print(report.fixed_mesh_note(), markup=False, highlight=False)
        return
    console.print(f"step time(N) = {report.timeline.step_time_expr}", markup=False, highlight=False)
    console.print(f"memory per rank(N) = {report.memory.symbolic} = {report.memory.formula} bytes",
                  markup=False, highlight=False)
