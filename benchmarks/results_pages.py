"""Render every benchmarks/results/*.json as a dated page beside it: ``python benchmarks/results_pages.py``.

A page gives when the JSON was last committed, the hardware, torch and dpar revision it records, the command
that writes it, what was measured and what it shows (``benchmarks/results/summaries/<name>.md``, written by
hand from the run), and the JSON's figures as tables: every dict whose values are numbers, strings or short
lists is a row, rows with the same keys one table. ``benchmarks/results/README.md`` lists the pages. The
reference pages under docs/ state no timings of their own and link here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
SUMMARIES = RESULTS / "summaries"
MAX_ROWS = 60

# The command that writes each JSON, and the hardware where the JSON does not record it.
COMMANDS: dict[str, tuple[str, str]] = {
    "born_sharded_memory": ("python benchmarks/born_sharded_memory.py", "2 CPU cores, 4 gloo ranks"),
    "born_sharded_memory_230m": ("python benchmarks/born_sharded_memory.py (2 layers)", "2 CPU cores, 4 gloo ranks"),
    "bucket_plan": ("python benchmarks/bucket_plan.py", "2 CPU cores, 2 gloo ranks"),
    "checkpoint_save": ("python benchmarks/checkpoint_save.py", "2 CPU cores, 2 gloo ranks, a loaded host"),
    "ddp_step_time": ("python benchmarks/ddp_step_time.py", ""),
    "ddp_step_time_inductor": ("python benchmarks/ddp_step_time.py --compiler inductor", ""),
    "local_sgd": ("python benchmarks/local_sgd.py", "2 CPU cores, 2 and 4 gloo ranks"),
    "measured_vs_modelled": ("python benchmarks/measured_vs_modelled.py", "2 CPU cores, 2 gloo ranks"),
    "measured_vs_modelled_checkpointing": (
        "python benchmarks/measured_vs_modelled.py --models llama-25m --strategies ddp,fsdp "
        "--activation-checkpointing keep,selective,full", "2 CPU cores, 2 gloo ranks"),
    "measured_vs_modelled_gpu_ddp": (
        "python benchmarks/measured_vs_modelled.py --device cuda --world-size 8 --models llama-500m",
        "one H100 standing in for rank 0 of 8 on torch's fake process group"),
    "measured_vs_modelled_gpu_ddp.measured": ("written by the same command on the GPU", "one H100"),
    "measured_vs_modelled_gpu_sharded": (
        "python benchmarks/measured_vs_modelled.py --device cuda --world-size 8 --models llama-500m",
        "one H100 standing in for rank 0 of 8 on torch's fake process group"),
    "measured_vs_modelled_gpu_sharded.measured": ("written by the same command on the GPU", "one H100"),
    "peak_memory": ("python benchmarks/peak_memory.py", "2 CPU cores, 2 gloo ranks"),
    "pipeline_step_time": ("python benchmarks/pipeline_step_time.py", ""),
    "pipeline_step_time_aot_eager+inductor": ("python benchmarks/pipeline_step_time.py --compilers aot_eager inductor", ""),
    "pipeline_step_time_compiled_check": (
        "python benchmarks/pipeline_step_time.py --compilers aot_eager inductor --schedules zb_h1 zbv", ""),
    "pipeline_step_time_zbv": ("python benchmarks/pipeline_step_time.py --schedules 1f1b zb_h1 zbv", ""),
    "plan_choice": ("python benchmarks/plan_choice.py --configs gpt-0.8m@4,gpt-0.8m@8,llama-4m@4,llama-4m@8 --steps 8 "
                    "--rounds 2", "2 CPU cores, 4 and 8 gloo ranks"),
    "plan_sweep": ("python benchmarks/plan_sweep.py", "modelled (h100 preset), not measured"),
    "plan_against_graphs": ("python benchmarks/plan_against_graphs.py",
                            "modelled (h100 preset) twice: by the search, and on the compiled graphs"),
    "sharded_step_time": ("python benchmarks/sharded_step_time.py", "2 CPU cores, 2 gloo ranks"),
    "step_breakdown": ("python benchmarks/step_breakdown.py --config llama-25m@8x128", "2 CPU cores, 2 gloo ranks"),
    "step_time_sweep": ("python benchmarks/step_time_sweep.py", ""),
    "tp_step_time": ("python benchmarks/tp_step_time.py --batch-size 32", ""),
    "zero_memory": ("python benchmarks/zero_memory.py", "counted, not timed"),
}


def committed_on(path: Path) -> str:
    """The date of the last commit that changed ``path`` (the run's date), or 'uncommitted'."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ad", "--date=short", "--", path.name],
                             cwd=path.parent, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out = ""
    return out or "uncommitted"


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str)) or (
        isinstance(value, list) and len(value) <= 6 and all(isinstance(v, (bool, int, float, str)) or v is None for v in value))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(value: Any, path: str, out: dict[tuple[str, ...], list[tuple[str, dict]]]) -> None:
    """Every dict under ``value`` with scalar entries becomes a row, grouped by its keys."""
    if isinstance(value, dict):
        scalars = {k: v for k, v in value.items() if _scalar(v)}
        if scalars:
            out[tuple(scalars)].append((path, scalars))
        for key, child in value.items():
            if not _scalar(child):
                _rows(child, f"{path}.{key}" if path else str(key), out)
    elif isinstance(value, list):
        if len(value) > 6 and all(isinstance(v, (int, float)) for v in value):
            return  # a long series (a loss curve, per-step times): in the JSON
        for i, child in enumerate(value):
            _rows(child, f"{path}[{i}]", out)


def tables(data: Any) -> list[str]:
    groups: dict[tuple[str, ...], list[tuple[str, dict]]] = defaultdict(list)
    top = {k: v for k, v in data.items() if _scalar(v)} if isinstance(data, dict) else {}
    rest = {k: v for k, v in data.items() if not _scalar(v)} if isinstance(data, dict) else data
    _rows(rest, "", groups)
    lines: list[str] = []
    if top:
        lines += ["| key | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in top.items()] + [""]
    for keys, rows in groups.items():
        lines += ["| where | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for where, row in rows[:MAX_ROWS]:
            lines.append(f"| {_fmt(where)} | " + " | ".join(_fmt(row[k]) for k in keys) + " |")
        if len(rows) > MAX_ROWS:
            lines.append(f"| ... {len(rows) - MAX_ROWS} more rows in the JSON | " + " | " * (len(keys) - 1) + " |")
        lines.append("")
    return lines


def page(path: Path) -> str:
    name = path.name.removesuffix(".json")
    data = json.loads(path.read_text())
    meta = data if isinstance(data, dict) else {}
    command, hardware = COMMANDS.get(name, ("", ""))
    hardware = meta.get("machine") or meta.get("device") or hardware
    backend = meta.get("backend")
    torch = meta.get("torch") or meta.get("torch_measured") or "not recorded"
    revision = meta.get("dpar_revision") or meta.get("revision") or "not recorded"
    lines = [f"# {name}", "", f"Generated from [`{path.name}`]({path.name}) by `python benchmarks/results_pages.py`.", "",
             "| run | |", "|---|---|", f"| date (last commit of the JSON) | {committed_on(path)} |",
             f"| hardware | {_fmt(hardware) or 'not recorded'}{f'; {backend}' if backend else ''} |",
             f"| torch | {torch} |", f"| dpar revision | {revision} |", f"| command | `{command}` |", ""]
    summary = SUMMARIES / f"{name}.md"
    if summary.exists():
        lines += ["## What was measured, and what it shows", "", summary.read_text().strip(), ""]
    lines += ["## Figures", ""] + tables(data)
    return "\n".join(lines).rstrip() + "\n"


def index(pages: list[Path]) -> str:
    lines = ["# Benchmark results", "", "Dated measurements, one page per JSON the benchmarks write; generated by "
             "`python benchmarks/results_pages.py`. Figures are what one machine measured on the date given; "
             "the reference pages in [docs/](../../docs/) state none of their own.", "",
             "| page | date | command |", "|---|---|---|"]
    for path in pages:
        name = path.name.removesuffix(".json")
        lines.append(f"| [{name}]({name}.md) | {committed_on(path)} | `{COMMANDS.get(name, ('', ''))[0]}` |")
    lines += ["", "Also here: [plan_sweep.md](plan_sweep.md) (the planner's modelled sweep, written by "
              "`benchmarks/plan_sweep.py`), [expert_parallel_step_time.md](expert_parallel_step_time.md) (written "
              "by `benchmarks/expert_parallel_step_time.py`), `plan_sweep.png`, `local_sgd.png`, and `profiles/` "
              "(`torch.profiler` traces of `benchmarks/step_breakdown.py`)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    pages = sorted(p for p in RESULTS.glob("*.json"))
    for path in pages:
        name = path.name.removesuffix(".json")
        if name == "plan_sweep":
            target = RESULTS / "plan_sweep_json.md"  # plan_sweep.md is the benchmark's own table
        else:
            target = RESULTS / f"{name}.md"
        target.write_text(page(path))
    (RESULTS / "README.md").write_text(index(pages).replace("[plan_sweep](plan_sweep.md)", "[plan_sweep](plan_sweep_json.md)"))
    print(f"wrote {len(pages)} pages and README.md under {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
