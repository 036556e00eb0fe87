"""How much of an all-reduce hides under compute on this machine: the ``overlap`` of the "cpu" preset.

    python benchmarks/comm_overlap.py                  # 2 gloo ranks, one compute thread each
    python benchmarks/comm_overlap.py --mb 15 --repeats 7

Each rank times, as medians over ``--repeats`` rounds taken in turn: an all-reduce of ``--mb`` MB
alone (``comm``), a loop of 512x512 matmuls alone (``compute``, sized to about ``comm``), and the
all-reduce issued asynchronously with the loop run while it is in flight (``together``). Then

    overlap = (comm + compute - together) / comm,  clamped to [0, 1]

1 means the all-reduce hid entirely under the loop, 0 that the two ran one after the other (on a
CPU, gloo's worker thread competes with the compute thread for the same cores). The ranks run under
a timeout and are killed past it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _seconds(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rank_main(rank: int, port: int, mb: float, repeats: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        payload = torch.ones(int(mb * 1e6) // 4)
        a, b = torch.randn(512, 512), torch.randn(512, 512)

        def comm() -> None:
            dist.all_reduce(payload)

        dist.all_reduce(payload)  # warm the connection
        comm_s = statistics.median(_seconds(comm) for _ in range(3))
        matmul_s = statistics.median(_seconds(lambda: a @ b) for _ in range(5))
        count = torch.tensor([max(1, round(comm_s / matmul_s))])
        dist.broadcast(count, 0)  # the same loop on both ranks

        def compute() -> None:
            for _ in range(int(count)):
                a @ b

        def together() -> None:
            work = dist.all_reduce(payload, async_op=True)
            compute()
            work.wait()

        times: dict[str, list[float]] = {"comm": [], "compute": [], "together": []}
        for _ in range(repeats):  # in turn, so a load that comes and goes falls on all three
            for name, fn in (("comm", comm), ("compute", compute), ("together", together)):
                times[name].append(_seconds(fn))
        results.put((rank, "ok", {name: statistics.median(t) for name, t in times.items()} | {"matmuls": int(count)}))
    except BaseException as exc:  # the parent reports it
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(mb: float, repeats: int, timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=rank_main, args=(r, port, mb, repeats, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(got) < 2:
            rank, status, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if status != "ok":
                raise SystemExit(f"rank {rank} failed: {payload}")
            got[rank] = payload
    except queue_module.Empty:
        raise SystemExit(f"ranks did not finish within {timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return got[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=15.0, help="all-reduce payload, MB")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    m = run(args.mb, args.repeats, args.timeout_s)
    overlap = min(1.0, max(0.0, (m["comm"] + m["compute"] - m["together"]) / m["comm"]))
    print(json.dumps({**m, "mb": args.mb, "overlap": round(overlap, 3)}, indent=2))


if __name__ == "__main__":
    main()
