"""Chrome / Perfetto trace JSON of a simulated timeline: a process per rank, a thread per stream.

Two timelines are written: a strategy's step (``timeline.Timeline``) and a pipeline schedule replayed
with per-action costs (``dpar.compiler.pipeline_parallel.simulate``), in the same format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpar.compiler.pipeline_parallel.simulate import SimulatedTimeline
    from dpar.inspect.timeline import Timeline

STREAMS = {"compute": 0, "comm": 1}


def trace_events(timeline: Timeline | SimulatedTimeline) -> list[dict[str, Any]]:
    """Complete ("X") events in microseconds, preceded by the names of ranks and streams."""
    events: list[dict[str, Any]] = []
    for rank in range(timeline.ranks_shown):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for stream, tid in STREAMS.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": stream}})
    for e in timeline.events:
        events.append({
            "ph": "X", "name": e.name, "cat": e.stream, "pid": e.rank, "tid": STREAMS[e.stream],
            "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": {"graph": e.graph},
        })
    return events


def write_trace(timeline: Timeline, path: Path) -> Path:
    doc = {
        "traceEvents": trace_events(timeline),
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
