"""DPAR_LOGS prints the passes' decisions during a real compile; artifacts reach torch's structured trace."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._logging._internal import trace_log
from torch.testing._internal.distributed.fake_pg import FakeStore

import dpar  # noqa: F401
from dpar.compiler import logs
from dpar.compiler.registry import figures_only
from dpar.explaining import explain


@pytest.fixture
def restore_dpar_loggers():
    saved = {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in logs.CHANNELS.values()}
    handlers = list(logging.getLogger("dpar").handlers)
    yield
    for name, (level, propagate) in saved.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).propagate = propagate
    logging.getLogger("dpar").handlers[:] = handlers
    logs._configured = None


def test_parse_channels_and_reject_unknown_ones():
    levels = logs.parse("passes,+graphs")
    assert levels["passes"] == logging.INFO and levels["graphs"] == logging.DEBUG
    assert levels["collectives"] == logging.WARNING
    assert set(logs.parse("all").values()) == {logging.INFO}
    with pytest.raises(ValueError, match="unknown channel 'pases'"):
        logs.parse("pases")


def test_dpar_logs_prints_pass_decisions_during_a_real_compile(monkeypatch, capsys, restore_dpar_loggers):
    monkeypatch.setenv("DPAR_LOGS", "passes,collectives")
    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        compiled(torch.randn(4, 16)).sum().backward()
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    err = capsys.readouterr().err
    assert "[dpar.passes] backward graph (sync): all_reduce_gradients: all_reduce: 0 -> 1, wait_tensor: 0 -> 1" in err
    assert "[dpar.collectives] backward graph (sync) #0: all_reduce float32[676] group=" in err
    assert "bytes=2704" in err


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_explain_writes_pass_graphs_collectives_and_report_as_structured_artifacts():
    capture, level = _Capture(), trace_log.level
    trace_log.addHandler(capture)  # what TORCH_TRACE=dir sets up, without the files
    trace_log.setLevel(logging.DEBUG)
    try:
        explain(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), (torch.randn(4, 16),), world_size=4)
    finally:
        trace_log.removeHandler(capture)
        trace_log.setLevel(level)
    artifacts = {}
    for record in capture.records:
        meta = getattr(record, "metadata", {})
        if "artifact" in meta:
            artifacts[meta["artifact"]["name"]] = getattr(record, "payload", None)
    assert "dpar_backward_graph_sync_after_all_reduce_gradients" in artifacts
    assert "_c10d_functional.all_reduce" in artifacts["dpar_backward_graph_sync_after_all_reduce_gradients"]
    assert json.loads(artifacts["dpar_backward_graph_sync_collectives"])[0]["bytes"] == 2704
    report = json.loads(artifacts["dpar_explain_report"])
    assert report["title"].startswith("dpar report: Sequential, ddp on 4 ranks")


def test_a_count_of_figures_alone_writes_no_pass_code_and_the_same_figures():
    """The planner's count on graphs (``figures_only``) keeps every pass's collective counts and the step's figures
    but writes no graph as Python; ``explain``'s own report keeps the code of every stage."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    full = explain(model, (torch.randn(4, 16),), world_size=4)
    with figures_only():
        counted = explain(model, (torch.randn(4, 16),), world_size=4)
    stages = [stage for graph in full.graphs for stage in graph.stages]
    assert all(isinstance(s.code, str) for s in stages)
    assert len(stages) > len(full.graphs) and "_c10d_functional" in stages[-1].code
    assert all(s.code is None for graph in counted.graphs for s in graph.stages)
    assert [[(s.pass_name, s.op_counts) for s in g.stages] for g in counted.graphs] == \
        [[(s.pass_name, s.op_counts) for s in g.stages] for g in full.graphs]
    assert counted.timeline.step_time == full.timeline.step_time
    assert counted.memory.total == full.memory.total
