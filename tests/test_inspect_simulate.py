"""The simulator on known cases: α-β exactly, sunk waits hide comm, step time's closed form in N."""

from __future__ import annotations

import dataclasses
import json

import pytest
import sympy
import torch
import torch.fx as fx
import torch.nn as nn

import dpar  # noqa: F401
from dpar.compiler.costs import ALPHA, BETA, B, N, PRESETS, DeviceSpec, comm_time, comm_time_expr
from dpar.explaining import explain
from dpar.inspect.simulate import Op, OpKind, simulate
from dpar.inspect.timeline import build_timeline, step_program

c10d = torch.ops._c10d_functional
H100 = PRESETS["h100"]
# Compute-heavy against its link, so that there is compute to hide communication behind.
SLOW_COMPUTE = DeviceSpec("slow compute", 20e9, 20e9, 5e9, alpha=20e-6, link_bandwidth=2e9)


def comm_only_graph(sizes: list[int]) -> fx.GraphModule:
    """All-reduces of fp32 tensors of ``sizes`` elements, each waited at once, no compute."""
    graph = fx.Graph()
    outputs = []
    for i, numel in enumerate(sizes):
        x = graph.placeholder(f"x{i}")
        x.meta["val"] = torch.empty(numel)
        reduced = graph.call_function(c10d.all_reduce.default, (x, "sum", "0"))
        outputs.append(graph.call_function(c10d.wait_tensor.default, (reduced,)))
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("n", [2, 8, 9, 64, 1024])
def test_comm_only_graph_takes_exactly_the_alpha_beta_time(n):
    """A world of up to 8 ranks (one node) rings over NVLink (1 us, 450 GB/s), a larger one over the NICs
    (5 us, 50 GB/s), as the planner prices a mesh (N,)."""
    sizes = [1000, 250_000]
    timeline = build_timeline([("g", comm_only_graph(sizes))], n, H100, ranks_shown=2)
    alpha, bandwidth = (1e-6, 450e9) if n <= 8 else (5e-6, 50e9)
    expected = sum(2 * (n - 1) * alpha + 2 * (n - 1) / n * 4 * k / bandwidth for k in sizes)
    assert timeline.step_time == pytest.approx(expected, rel=1e-12)
    assert timeline.comm_time == pytest.approx(expected, rel=1e-12)
    assert timeline.compute_time == 0
    assert timeline.overlap == 0.0
    # The closed form is the same sum, for every N past a node.
    closed = sum(comm_time_expr("all_reduce").subs({B: 4 * k, ALPHA: 5e-6, BETA: 1 / 50e9}) for k in sizes)
    assert sympy.simplify(timeline.step_time_expr.subs(N, n) - closed.subs(N, n)) == 0 or n <= 8


def test_alpha_beta_formulas_match_the_ring_and_tree_counts():
    assert comm_time("all_reduce", 8000, 4, H100) == pytest.approx(6 * 5e-6 + 1.5 * 8000 / 50e9)
    assert comm_time("all_gather", 8000, 4, H100) == pytest.approx(3 * 5e-6 + 0.75 * 8000 / 50e9)
    assert comm_time("reduce_scatter", 8000, 4, H100) == pytest.approx(3 * 5e-6 + 0.75 * 8000 / 50e9)
    assert comm_time("broadcast", 8000, 8, H100) == pytest.approx(3 * (5e-6 + 8000 / 50e9))
    assert all(comm_time(k, 8000, 1, H100) == 0 for k in ("all_reduce", "all_gather", "broadcast"))


def test_hand_schedule_late_wait_hides_the_collective_behind_compute():
    late = [Op(OpKind.ISSUE, "ar", 3.0, 0), Op(OpKind.COMPUTE, "mm", 2.0), Op(OpKind.WAIT, "w", collective=0),
            Op(OpKind.COMPUTE, "add", 1.0)]
    early = [late[0], late[2], late[1], late[3]]
    assert simulate({0: late, 1: late}).step_time == 4.0  # 3 s of comm, 2 of them hidden
    assert simulate({0: early, 1: early}).step_time == 6.0  # nothing hidden


def test_collectives_of_different_groups_run_side_by_side():
    """Each process group has its own comm stream (NCCL runs each communicator on its own): a tensor-parallel
    all-reduce does not queue behind a data-parallel reduce-scatter issued before it; one group's run in turn."""
    program = [Op(OpKind.ISSUE, "rs", 3.0, 0, group="dp"), Op(OpKind.ISSUE, "ar", 1.0, 1, group="tp"),
               Op(OpKind.WAIT, "w1", collective=1), Op(OpKind.COMPUTE, "mm", 2.0), Op(OpKind.WAIT, "w0", collective=0)]
    assert simulate({0: program, 1: program}).step_time == 3.0  # ar 0-1, mm 1-3 beside rs 0-3
    one_group = [dataclasses.replace(op, group="dp") for op in program]
    assert simulate({0: one_group, 1: one_group}).step_time == 6.0  # rs 0-3, then ar 3-4, mm 4-6


def test_rank_waiting_for_a_collective_another_rank_never_issues_is_reported():
    with pytest.raises(RuntimeError, match="never issued"):
        simulate({0: [Op(OpKind.ISSUE, "ar", 1.0, 0), Op(OpKind.WAIT, "w", collective=0)], 1: []})


def deep_mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())]
    return nn.Sequential(*layers), (torch.randn(512, 256),)


def test_sunk_waits_hide_more_communication_than_waits_next_to_their_collective():
    options = {"bucket_cap_mb": 0.25}
    sunk = explain(*deep_mlp(), world_size=8, device=SLOW_COMPUTE, options=options).timeline
    kept = explain(*deep_mlp(), world_size=8, device=SLOW_COMPUTE, options={**options, "sink_waits": False}).timeline
    assert sunk.comm_time == pytest.approx(kept.comm_time) and sunk.comm_time > 0
    assert sunk.compute_time == pytest.approx(kept.compute_time)
    assert kept.exposed_comm == pytest.approx(kept.comm_time)  # each wait right after its collective
    assert kept.overlap == pytest.approx(0.0, abs=1e-9)
    assert sunk.exposed_comm < 0.5 * kept.exposed_comm
    assert sunk.overlap > 0.5


def test_step_time_follows_its_closed_form_in_n():
    """Comm-bound (H100 link, tiny model): step = compute before the first issue + every all-reduce."""
    report = explain(*deep_mlp(), world_size=64, options={"bucket_cap_mb": 0.25})
    timeline = report.timeline
    program = step_program([(g.label, g.graph) for g in report.graphs], H100)
    first_issue = next(i for i, op in enumerate(program) if op.kind is OpKind.ISSUE)
    before = sum(op.seconds for op in program[:first_issue] if op.kind is OpKind.COMPUTE)
    for n in (64, 256, 1024):
        closed = before + sum(comm_time("all_reduce", c.bytes, n, H100) for c in report.collectives)
        assert timeline.step_time_at(n) == pytest.approx(closed, rel=1e-9)
        assert float(timeline.step_time_expr.subs(N, n)) == pytest.approx(closed, rel=1e-9)
    assert timeline.step_time == pytest.approx(timeline.step_time_at(64), rel=1e-12)
    # Linear in N for large N: the ring's 2(N-1) latency steps per all-reduce, on the NICs past a node.
    past_a_node = sympy.piecewise_fold(timeline.step_time_expr).args[-1][0]
    slope = sympy.limit(sympy.diff(past_a_node, N), N, sympy.oo)
    assert float(slope) == pytest.approx(2 * len(report.collectives) * 5e-6)


def test_trace_json_loads_with_compute_and_comm_tracks_for_every_rank(tmp_path):
    report = explain(*deep_mlp(), world_size=4, device="cpu", options={"bucket_cap_mb": 0.25})
    path = report.timeline.save(tmp_path / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(r, s) for r in range(4) for s in ("compute", "comm")}
    spans = [e for e in events if e["ph"] == "X"]
    for rank in range(4):
        comm = [e for e in spans if e["pid"] == rank and e["tid"] == 1]
        compute = [e for e in spans if e["pid"] == rank and e["tid"] == 0]
        assert len(comm) == len(report.collectives) and compute
        assert sum(e["dur"] for e in comm) == pytest.approx(report.timeline.comm_time * 1e6)
    end = max(e["ts"] + e["dur"] for e in spans)
    assert end == pytest.approx(report.timeline.step_time * 1e6)


def test_timeline_png_is_written(tmp_path):
    report = explain(*deep_mlp(), world_size=2, device="cpu", options={"bucket_cap_mb": 0.25})
    png = report.timeline.plot(tmp_path / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
