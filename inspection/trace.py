"""Chrome / Perfetto trace JSON of a simulated timeline: a process per rank, a thread per stream (a comm
stream per process group).

Two timelines are written: a strategy's step (``timeline.Timeline``) and a pipeline schedule replayed
with per-action costs (``dpar.compiler.pipeline_parallel.simulate``), in the same format."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpar.compiler.pipeline_parallel.simulate import SimulatedTimeline
    from dpar.inspect.timeline import Timeline

def trace_events(timeline: Timeline | SimulatedTimeline) -> list[dict[str, Any]]:
    """Complete ("X") events in microseconds, preceded by the names of ranks and streams."""
    groups = sorted({getattr(e, "group", "") for e in timeline.events if e.stream == "comm"}) or [""]
    threads = {("compute", ""): ("compute", 0)}
    for i, group in enumerate(groups):
        threads["comm", group] = (f"comm (group {group})" if len(groups) > 1 else "comm", 1 + i)
    events: list[dict[str, Any]] = []
    for rank in range(timeline.ranks_shown):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for name, tid in threads.values():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
    for e in timeline.events:
        key = (e.stream, getattr(e, "group", "") if e.stream == "comm" else "")
        events.append({
            "ph": "X", "name": e.name, "cat": e.stream, "pid": e.rank, "tid": threads[key][1],
            "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": {"graph": e.graph},
        })
    return events


def memory_counter(timeline: Timeline, memory: Sequence[tuple[str, str, int]]) -> list[dict[str, Any]]:
    """Counter ("C") events on rank 0: the bytes above the state after each node (``Report.memory_timeline``),
    at the end of the node's compute event; a node with none (a view, a collective's issue or wait) at the
    time the one before it ended."""
    ends = {(e.graph, e.name): e.end for e in timeline.events if e.rank == 0 and e.stream == "compute"}
    events, now = [], 0.0
    for graph, node, nbytes in memory:
        now = ends.get((graph, node), now)
        events.append({"ph": "C", "name": "memory above the state", "pid": 0, "ts": now * 1e6,
                       "args": {"MiB": nbytes / 2**20}})
    return events


def write_trace(timeline: Timeline, path: Path, memory: Sequence[tuple[str, str, int]] = ()) -> Path:
    doc = {
        "traceEvents": trace_events(timeline) + memory_counter(timeline, memory),
        "displayTimeUnit": "ms",
        "otherData": {
            "world_size": timeline.world_size,
            "ranks_shown": timeline.ranks_shown,
            "device": timeline.device,
            "step_time_s": timeline.step_time,
            "exposed_comm_s": timeline.exposed_comm,
            "overlap": timeline.overlap,
        },
    }
    path.write_text(json.dumps(doc))
    return path


def write_schedule_trace(timeline: SimulatedTimeline, path: str | Path) -> Path:
    """A simulated pipeline schedule: a process per rank, compute and send/recv threads."""
    doc: dict[str, Any] = {
        "traceEvents": trace_events(timeline),
        "displayTimeUnit": "ms",
        "otherData": {"schedule": str(timeline.schedule).splitlines()[0], "span_s": timeline.span,
                      "bubble": list(timeline.bubble), "peak_in_flight": list(timeline.peak_in_flight)},
    }
    path = Path(path)
    path.write_text(json.dumps(doc))
    return path
