"""dpar's daemon thread never reads the main thread's frames ([Note: no thread reads another thread's
frames] in runtime/liveness.py): under torch.compile a frame object made from another thread can outlive
its frame and crash the process (benchmarks/frame_walk_crash.py).

Two gloo ranks, tensor parallel. Rank 1 arrives 2.5 s late at the backward's check, so rank 0 waits
there and asks it where it is (the daemon thread answers); in step 2 rank 1 is late again, while rank 0
waits inside its backward graph for it (the daemon thread beats with rank 0 blocked in a wait). Every
call of ``sys._current_frames`` on a rank is counted, with the thread that made it.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from distributed import run_ranks
from tensor_parallel_training import compiled_tp_mlp

LATE_S = 2.5


def _train(rank: int, world_size: int) -> dict[str, object]:
    from dpar.runtime import liveness

    calls: list[str] = []
    current_frames = sys._current_frames

    def counted() -> dict[int, object]:
        calls.append(threading.current_thread().name)
        return current_frames()

    sys._current_frames = counted
    runner, x, y = compiled_tp_mlp(rank)
    waits: list[str] = []
    for step in range(1, 4):
        loss = torch.nn.functional.mse_loss(runner(x), y)
        if rank == 1 and step in (1, 2):
            time.sleep(LATE_S)  # step 1: rank 0 waits at the backward's check; step 2: inside the backward
        loss.backward()
        waits.append(liveness.where_recorded())
    sys._current_frames = current_frames
    return {"calls": calls, "where": waits[-1]}


def test_the_daemon_thread_reads_no_frames_of_the_main_thread() -> None:
    results = run_ranks(_train, 2)
    for rank, result in enumerate(results):
        assert result["calls"] == [], f"rank {rank}: sys._current_frames called from {sorted(set(result['calls']))}"
        # What a peer is told instead: the user code the main thread recorded entering the graph from.
        assert "test_peer_progress_thread.py:" in result["where"] and "in _train" in result["where"], result["where"]
