"""Ranks alive but blocked in collectives that do not pair: the rank that waits for a collective every
peer has issued ends with ``CollectiveStallError``, its peer with ``RankLostError`` naming it, within
the bound (runtime/liveness.py, [Note: ranks alive but stuck in different collectives]).

The ranks are plain processes under a timeout, as in test_dead_rank.py: ``run_ranks`` would kill the
peer as soon as the stalled rank ends, and what the peer does then is under test.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
STALLED_AFTER_S = 4.0  # the default is 30 s; the mechanism is the same
# WATCH_AFTER_S + STALLED_AFTER_S, two beats, and room for two busy cores.
BOUND_S = 3.0 + STALLED_AFTER_S + 2.0 + 6.0
STRAY_AT = 2  # 1-based step in whose backward the collectives are mismatched


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, out: str) -> None:
    sys.path[:0] = [str(HERE)]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.dup2(os.open(f"{out}/stderr.{rank}", os.O_WRONLY | os.O_CREAT), 2)
    torch.set_num_threads(1)
    import torch.distributed as dist

    from dpar.runtime import liveness
    from tensor_parallel_training import compiled_tp_mlp

    liveness.STALLED_AFTER_S = STALLED_AFTER_S
    dist.init_process_group("gloo")
    runner, x, y = compiled_tp_mlp(rank)
    try:
        for step in range(1, 4):
            loss = torch.nn.functional.mse_loss(runner(x), y)
            if step == STRAY_AT:
                # One collective on rank 0 only, on the group the graphs use: every later pair is shifted, and
                # gloo pairs a collective by kind and count, so the backward's all-reduces (its gathers too, on
                # gloo: [Note: no all-gather on gloo]) never meet their peer's. A stray all-reduce would meet
                # one of another size instead, which gloo's transport refuses by aborting the process
                # ("Received data size doesn't match expected size").
                if rank == 0:
                    dist.broadcast(torch.ones(3), src=0, async_op=True)
                Path(f"{out}/stray.{rank}").write_text(str(time.time()))
            loss.backward()
    except Exception as exc:
        Path(f"{out}/error.{rank}").write_text(json.dumps({"type": type(exc).__name__, "message": str(exc), "at": time.time()}))
        raise
    dist.destroy_process_group()


def test_a_rank_waiting_for_a_collective_every_peer_has_issued_ends_with_a_named_error(tmp_path: Path) -> None:
    import dpar

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 240
    exited_at: dict[int, float] = {}
    try:
        while len(exited_at) < 2 and time.monotonic() < deadline:
            exited_at.update({r: time.time() for r, p in enumerate(procs) if r not in exited_at and not p.is_alive()})
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    assert len(exited_at) == 2, f"ranks {sorted(set(range(2)) - set(exited_at))} hung"
    stray = max(float((tmp_path / f"stray.{r}").read_text()) for r in range(2))
    stalled = (tmp_path / "stderr.1").read_text()
    # Rank 1 issued one collective fewer and waits for one rank 0 has issued: it is the one to tell.
    assert procs[1].exitcode == 1, stalled
    assert f"dpar.CollectiveStallError: rank 1 is blocked in a collective in the backward of step {STRAY_AT}" in stalled
    assert "(in a collective in the backward graph), and no rank has issued another" in stalled
    assert f"rank 0 (in the backward of step {STRAY_AT}, blocked in a collective in the backward graph)" in stalled
    assert "collectives issued on group" in stalled and "a stray dist.all_reduce" in stalled
    assert exited_at[1] - stray < BOUND_S, exited_at[1] - stray
    # Rank 0, behind nobody, never declares; rank 1's exit fails its collective and it names rank 1 and why.
    error = json.loads((tmp_path / "error.0").read_text())
    assert procs[0].exitcode == 1
    assert error["type"] == dpar.RankLostError.__name__, error
    assert f"rank 0 lost rank(s) [1] in the backward of step {STRAY_AT}" in error["message"]
    assert "rank 1 left: CollectiveStallError: blocked in a collective" in error["message"]
    assert error["at"] - stray < BOUND_S + 3.0, error["at"] - stray
    print(f"CollectiveStallError {exited_at[1] - stray:.1f} s after the stray collective, "
          f"the peer's RankLostError {error['at'] - stray:.1f} s after")
