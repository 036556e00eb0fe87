"""Wall-clock budgets for planning and inspection, scaled to how fast this host runs Python right now.

The shared cores these tests run on run the same Python 1-2x slower from one day to the next (a 10^7-step loop
took 0.36 s on one day and 1.8 s on another, the suite's own ranks contending for the cores). A budget is written
for a host whose loop takes a second, and stretched, never shrunk, on a slower one. The loop does not see every
slow day: on 2026-11-30 it took 0.45 s while allocation ran slow (a million small dicts in 1.9 s) and the 24-block
GPT planned in 11.3-12.1 s at this code and at the last code CI had passed alike; the budgets keep a margin for it.
"""

from __future__ import annotations

import time

REFERENCE_LOOP_S = 1.0


def python_loop_s() -> float:
    """Seconds this host takes for a 10^7-step Python loop now."""
    start = time.perf_counter()
    for _ in range(10**7):
        pass
    return time.perf_counter() - start


def budget_s(seconds: float) -> float:
    """``seconds`` on the reference host, stretched by how much slower this one runs Python now."""
    return seconds * max(1.0, python_loop_s() / REFERENCE_LOOP_S)
