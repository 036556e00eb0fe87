"""The documentation runs and stays true: the quickstart's scripts train on 2 gloo ranks, every shell line names
flags the `dpar` command has, every relative link resolves, and docs/reference.md and docs/notes.md equal what
docs/generate_reference.py makes of the code."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
QUICKSTART = ROOT / "docs" / "quickstart.md"


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), re.S)


def _run_script(rank: int, world_size: int, source: str) -> float:
    """The script as written, in a rank the harness started: its ``init_process_group`` (gloo, as the script
    itself picks without CUDA) is already made, so the script's own call is a no-op here."""
    import torch.distributed as dist

    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *args, **kwargs: None
    dist.destroy_process_group = lambda *args, **kwargs: None
    scope: dict = {"__name__": "__main__"}
    try:
        exec(compile(source, "quickstart", "exec"), scope)
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy
    return float(scope["loss"].item())


def test_every_python_block_of_readme_and_quickstart_compiles() -> None:
    for page in (ROOT / "README.md", QUICKSTART):
        for i, source in enumerate(blocks(page, "python")):
            compile(source, f"{page.name} block {i}", "exec")


@pytest.mark.parametrize("which", [0, 1], ids=["ddp_drop_in", "fsdp_hf_llama_bf16"])
def test_quickstart_script_trains_on_two_gloo_ranks(which: int) -> None:
    import torch

    from distributed import run_ranks

    source = blocks(QUICKSTART, "python")[which]
    losses = run_ranks(_run_script, 2, source, timeout_s=180)
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses)


def _dpar_lines() -> list[tuple[str, list[str]]]:
    lines = []
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for block in blocks(page, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith("dpar "):
                    lines.append((f"{page.name}: {line}", shlex.split(line)[1:]))
    return lines


def test_every_dpar_command_line_in_the_docs_parses() -> None:
    from dpar.cli import parser

    lines = _dpar_lines()
    assert len(lines) >= 5
    for where, argv in lines:
        try:
            args = parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: dpar's parser refuses it")
        target = args.target.split(":")[0]
        if target.endswith(".py"):
            assert (ROOT / target).is_file(), f"{where}: no file {target}"


def test_readme_test_command_is_what_ci_runs() -> None:
    assert "python -m pytest -q\n" in (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in (ROOT / "README.md").read_text()


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_every_results_json_has_its_page() -> None:
    results = ROOT / "benchmarks" / "results"
    missing = [p.name for p in results.glob("*.json")
               if not (results / (p.name.removesuffix(".json") + ".md")).exists() and p.stem != "plan_sweep"]
    assert not missing, f"run python benchmarks/results_pages.py (no page for {missing})"


def test_reference_and_note_index_equal_the_code() -> None:
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import generate_reference
    finally:
        sys.path.remove(str(ROOT / "docs"))
    for rel, make in generate_reference.PAGES.items():
        assert (ROOT / rel).read_text() == make(), f"{rel} is stale: run {generate_reference.COMMAND}"


@pytest.mark.extended
def test_quickstart_plans_llama3_70b() -> None:
    """The quickstart's plan of Llama-3-70B on paper, run whole (tens of seconds and GBs of meta modelling)."""
    import contextlib
    import io

    from dpar.cli import main

    argv = next(argv for where, argv in _dpar_lines() if "quickstart" in where and argv[0] == "plan")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    assert "fsdp" in out.getvalue()
