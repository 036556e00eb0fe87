"""The timeline as a PNG: one row per (rank, stream), compute and comm in different colours."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpar.inspect.timeline import Timeline

COLOURS = {"compute": "#4c72b0", "comm": "#dd8452"}


def plot_timeline(timeline: Timeline, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    rows = [(r, s) for r in range(timeline.ranks_shown) for s in ("compute", "comm")]
    fig, ax = plt.subplots(figsize=(11, 0.5 + 0.45 * len(rows)))
    for y, (rank, stream) in enumerate(rows):
        spans = [(e.start * 1e3, (e.end - e.start) * 1e3) for e in timeline.events
                 if e.rank == rank and e.stream == stream]
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLOURS[stream], edgecolor="white", linewidth=0.2)
    ax.set_yticks(range(len(rows)), [f"rank {r} {s}" for r, s in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_xlim(0, max(timeline.step_time * 1e3, 1e-9))
    ax.set_title(
        f"simulated step at N = {timeline.world_size} ({timeline.device}): "
        f"{timeline.step_time * 1e3:.3f} ms, exposed comm {timeline.exposed_comm * 1e3:.3f} ms, "
        f"overlap {timeline.overlap:.0%}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
