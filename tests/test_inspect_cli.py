"""``dpar inspect``: targets by file or module, the tables it prints, the files it writes."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
import torch
from machine_speed import budget_s

from dpar.cli import load_target, main
from dpar.compiler.costs import PRESETS
from dpar.explaining import explain

ROOT = Path(__file__).resolve().parent.parent
TARGET = '''
import torch, torch.nn as nn

def default():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), (torch.randn(4, 16),)

def wide():
    return nn.Linear(8, 1024), (torch.randn(2, 8),)
'''


@pytest.fixture
def target_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_model.py"
    path.write_text(textwrap.dedent(TARGET))
    return path


def test_file_target_uses_default_and_prints_the_tables(target_file, capsys):
    assert main(["inspect", str(target_file), "--world-size", "8", "--bucket-cap-mb", str(500 / 2**20)]) == 0
    out = capsys.readouterr().out
    assert "dpar report: Sequential, ddp on 8 ranks" in out
    assert "all_reduce_gradients: all_reduce: 0 -> 2" in out
    assert "2.bias, 2.weight" in out and "0.bias, 0.weight" in out
    assert "528" in out and "2,176" in out and "924" in out  # payload and 2(N-1)/N of it at N = 8
    assert "15,168" in out  # 4 x 2,704 (parameters, gradients, AdamW state) + 4,352 activation peak
    assert "Step time in N" in out


def test_file_and_module_targets_name_a_function(target_file, monkeypatch):
    model, _ = load_target(f"{target_file}:wide")()
    assert isinstance(model, torch.nn.Linear)
    monkeypatch.syspath_prepend(str(target_file.parent))
    model, _ = load_target("tiny_model:wide")()
    assert model.out_features == 1024
    with pytest.raises(SystemExit, match="no function 'missing'"):
        load_target(f"{target_file}:missing")


def test_cli_writes_trace_png_dot_and_html(target_file, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    argv = ["inspect", str(target_file), "-n", "4", "--device", "cpu", "--trace", str(out / "t.json"),
            "--png", str(out / "t.png"), "--dot", str(out / "dot"), "--html", str(out / "r.html")]
    assert main(argv) == 0
    trace = json.loads((out / "t.json").read_text())
    assert trace["otherData"]["world_size"] == 4
    memory = [e for e in trace["traceEvents"] if e["ph"] == "C"]  # the memory timeline, rank 0
    assert memory and [e["ts"] for e in memory] == sorted(e["ts"] for e in memory)
    assert memory[-1]["ts"] <= trace["otherData"]["step_time_s"] * 1e6
    assert (out / "t.png").read_bytes()[:4] == b"\x89PNG"
    dots = sorted(p.name for p in (out / "dot").iterdir())
    assert "backward_graph_sync.dot" in dots and "forward_graph.dot" in dots
    assert "all_reduce" in (out / "dot" / "backward_graph_sync.dot").read_text()
    page = (out / "r.html").read_text()
    assert "<title>dpar report: Sequential, ddp on 4 ranks (cpu)</title>" in page
    assert 'id="collectives"' in page and 'class="collective"' in page


def test_gpt_example_at_1024_ranks_in_under_a_minute_with_the_formulas_numbers(capsys):
    """The issue's acceptance run: bytes per collective, per-rank memory and collective count."""
    start = time.perf_counter()
    assert main(["inspect", str(ROOT / "examples" / "gpt.py"), "--world-size", "1024", "--strategy", "ddp"]) == 0
    elapsed = time.perf_counter() - start
    assert elapsed < budget_s(60), f"dpar inspect took {elapsed:.1f} s"
    out = capsys.readouterr().out
    assert "ddp on 1024 ranks" in out

    model, inputs = load_target(str(ROOT / "examples" / "gpt.py"))()
    report = explain(model, inputs, world_size=1024)
    params = {id(p): p for p in model.parameters()}.values()  # tied embedding counted once
    grad_bytes = sum(p.numel() * 4 for p in params)
    assert len(report.collectives) == -(-grad_bytes // (25 * 2**20))  # 25 MiB buckets: one
    assert sum(c.bytes for c in report.collectives) == grad_bytes
    n, h100 = 1024, PRESETS["h100"]
    for c in report.collectives:
        assert c.moved_bytes == pytest.approx(2 * (n - 1) / n * c.bytes)
        assert c.seconds == pytest.approx(2 * (n - 1) * h100.alpha + c.moved_bytes / h100.link_bandwidth)
    m = report.memory
    assert (m.parameters, m.gradients, m.optimizer) == (grad_bytes, grad_bytes, 2 * grad_bytes)
    assert f"{grad_bytes:,}" in out and f"{m.total:,}" in out
