"""Host work the graphs' kernels do not show (see [Note: host work the graphs' kernels do not show] in
compiler/costs.py): each collective's calling-thread seconds and the work around the graphs per parameter
and buffer, compute time on the cpu preset, nothing on the GPU presets."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from dpar.compiler.collectives import COLLECTIVE_KINDS
from dpar.compiler.costs import PRESETS
from dpar.explaining import explain
from dpar.inspect.simulate import OpKind


class LinearsAndNorm(nn.Module):
    """Four Linears (8 parameters) and a BatchNorm (2 parameters, 3 buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
        self.norm = nn.BatchNorm1d(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x)).square().mean()


def _report(strategy: str, device):
    torch.manual_seed(0)
    return explain(LinearsAndNorm(), (torch.randn(8, 32),), world_size=2, strategy=strategy, device=device)


def _collectives(report) -> int:
    return sum(1 for _, gm in _priced_graphs(report) for n in gm.graph.nodes if n.target in COLLECTIVE_KINDS)


def _priced_graphs(report):
    return [(view.label, view.graph) for view in report.graphs
            if view.label.endswith(("forward graph", "backward graph", "backward graph (sync)"))]


@pytest.mark.parametrize("strategy, per_parameter", [("ddp", 9e-6), ("fsdp", 60e-6)])
def test_cpu_preset_prices_the_work_around_the_graphs_per_parameter_and_buffer(strategy: str, per_parameter: float) -> None:
    # ddp's parameters are plain tensors, fsdp's DTensors (their wrapping and dispatch run in Python); the
    # BatchNorm's 3 buffers stay plain under both.
    report = _report(strategy, "cpu")
    assert PRESETS["cpu"].tensor_host_seconds == (9e-6, 60e-6)
    assert report.host_around_graphs == pytest.approx(10 * per_parameter + 3 * 9e-6)
    around = [op for op in report.timeline.program if op.name == "host work around the graphs"]
    assert [op.seconds for op in around] == [pytest.approx(report.host_around_graphs)]
    assert report.timeline.program[0] is around[0]  # before the first graph
    assert any("host work around the graphs" in str(row) for row in report.timeline_table().rows)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_each_collective_costs_the_compute_stream_its_host_seconds_before_it_is_issued(strategy: str) -> None:
    report = _report(strategy, "cpu")
    program = report.timeline.program
    issues = [i for i, op in enumerate(program) if op.kind is OpKind.ISSUE]
    assert len(issues) == _collectives(report) > 0
    for i in issues:
        host = program[i - 1]
        assert host.kind is OpKind.COMPUTE and host.name == f"{program[i].name} (host)"
        assert host.seconds == PRESETS["cpu"].collective_host_seconds == 45e-6
    # The compute time is the graphs' kernels plus all of it: priced again without host work, it falls by that.
    bare = dataclasses.replace(PRESETS["cpu"], collective_host_seconds=0.0, tensor_host_seconds=(0.0, 0.0))
    without = _report(strategy, bare)
    assert without.host_around_graphs == 0.0
    assert not any("(host)" in op.name for op in without.timeline.program)
    assert report.timeline.compute_time - without.timeline.compute_time == pytest.approx(
        report.host_around_graphs + len(issues) * 45e-6)


def test_gpu_presets_price_no_host_work() -> None:
    # A GPU's host thread runs ahead of its streams: the compute stream pays none of it.
    report = _report("fsdp", "h100")
    assert report.host_around_graphs == 0.0
    assert not any("host" in op.name for op in report.timeline.program)
    assert not any("host work" in str(row) for row in report.timeline_table().rows)
