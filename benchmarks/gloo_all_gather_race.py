"""An all-gather beside another collective on one gloo process group corrupts the heap: no dpar.

Four gloo ranks; each round, every rank issues functional collectives on its 2-rank sub-group ({0, 1} or
{2, 3}), the way a compiled graph does (``torch.ops._c10d_functional``, the caller dropping its reference to
each input once issued, the waits later), and allocates a few small tensors meanwhile. Runs go on for
``--seconds``; a rank killed by a signal ends the run. Schedules:

- ``gathers``: four all-gathers in flight at a time; ``gathers-kept``: the same, each input held 2 ms past the
  round's waits;
- ``gathers-as-all-reduces``: four all-gathers in flight as dpar runs them on gloo: each an all-reduce of the
  rank's block among zeros (compiler/passes/gloo_all_gathers.py);
- ``gather-beside-reduce``: all-reduces in flight, each all-gather waited at once;
- ``gather-alone``: all-reduces in flight, but before each all-gather every collective in flight is waited,
  and the all-gather is waited at once (what dpar's graphs did on gloo before they ran no all-gather);
- ``reduces``: four all-reduces in flight at a time; ``scatters``: four reduce-scatters;
- ``all-to-alls``: four all-to-alls in flight; ``all-to-all-beside-reduce``: all-reduces in flight, each
  all-to-all waited at once (expert and context parallel's all-to-alls beside gradient all-reduces).

    python benchmarks/gloo_all_gather_race.py --runs 3 --seconds 60

[Note: what the gloo all-gather race measured]
torch 2.13.0+cpu, Python 3.11.7, glibc 2.36, 2 shared cores, 2026-11-28, runs of 45-60 s (the first 3 of each
schedule with the same program before it took this form, the fourth with this script): ``gathers`` a rank died
in 4 of 4 runs (SIGABRT with "malloc(): unaligned tcache chunk detected" or "malloc_consolidate(): unaligned
fastbin chunk detected", or SIGSEGV), also in 3 of 3 with 1-D inputs, in 2 of 2 with two sub-groups per rank
(a 2 x 2 mesh) and in 1 of 2 with each input kept alive to its wait; ``gather-beside-reduce`` 2 of 3;
all-gathers waited one at a time with nothing else in flight 0 of 3; ``reduces`` 0 of 3; ``scatters`` 0 of 3;
``gather-alone`` 0 of 4. All-to-alls (the same day, 45 s runs): ``all-to-alls`` 0 of 2,
``all-to-all-beside-reduce`` 0 of 2. 2026-11-29, 40-45 s runs: ``gathers`` 1 of 1 more, ``gathers-kept`` 2 of 2
(SIGSEGV: holding the inputs does not help), ``gathers-as-all-reduces`` 0 of 2.
The first two die the way dpar's tensor-parallel runs on gloo died: the heap found corrupted by a gloo worker
thread inside ``AsyncAllgatherCoalescedWork``. torch 2.14.1 (the same day, ``gathers``, 45 s): 2 of 2 runs
(SIGABRT, SIGSEGV). Not measured on earlier versions.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

c10d = torch.ops._c10d_functional
SCHEDULES = ("gathers", "gathers-kept", "gathers-as-all-reduces", "gather-beside-reduce", "gather-alone", "reduces", "scatters", "all-to-alls",
             "all-to-all-beside-reduce")


def _round(schedule: str, group: str) -> None:
    """One round of ``schedule`` on ``group``: issue, drop the inputs, allocate, wait."""
    in_flight: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    rank = dist.get_rank() % 2
    for k in range(4):
        x = torch.randn(16, 128) * 1.0  # a graph's intermediate: it has a Python object
        if schedule in ("gathers", "gathers-kept"):
            in_flight.append(c10d.all_gather_into_tensor(x, 2, group))
            if schedule == "gathers-kept":
                kept.append(x)
        elif schedule == "gathers-as-all-reduces":
            blocks = [x if j == rank else torch.zeros_like(x) for j in range(2)]
            in_flight.append(c10d.all_reduce(torch.cat(blocks), "sum", group))
        elif schedule == "reduces":
            in_flight.append(c10d.all_reduce(x, "sum", group))
        elif schedule == "scatters":
            in_flight.append(c10d.reduce_scatter_tensor(x, "sum", 2, group))
        elif schedule == "all-to-alls":
            in_flight.append(c10d.all_to_all_single(x, [8, 8], [8, 8], group))
        elif schedule == "all-to-all-beside-reduce":
            in_flight.append(c10d.all_reduce(x, "sum", group))
            in_flight.append(c10d.wait_tensor(c10d.all_to_all_single(x * 1.0, [8, 8], [8, 8], group)))
            in_flight.append(c10d.all_reduce(x * 2.0, "sum", group))
        else:
            in_flight.append(c10d.all_reduce(x, "sum", group))
            if schedule == "gather-alone":
                in_flight = [c10d.wait_tensor(t) for t in in_flight]
            in_flight.append(c10d.wait_tensor(c10d.all_gather_into_tensor(x * 1.0, 2, group)))
            in_flight.append(c10d.all_reduce(x * 2.0, "sum", group))
        del x
        small = [torch.empty(k + 1) for _ in range(20)]
        del small
    for t in in_flight:
        c10d.wait_tensor(t)
    if kept:
        time.sleep(0.002)
        kept.clear()


def _rank(rank: int, world_size: int, port: int, schedule: str, seconds: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2].group_name
    start = time.monotonic()
    while True:
        stop = torch.tensor([float(time.monotonic() - start > seconds)])
        dist.all_reduce(stop)  # every rank ends at the same round
        if stop.item() > 0:
            break
        _round(schedule, group)
    dist.destroy_process_group()


def _run(schedule: str, seconds: float) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=_rank, args=(r, 4, port, schedule, seconds)) for r in range(4)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(seconds + 300)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in ranks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    args = parser.parse_args()
    for schedule in args.schedules:
        died = 0
        for run in range(1, args.runs + 1):
            codes = _run(schedule, args.seconds)
            signals = [signal.Signals(-c).name for c in codes if c is not None and c < 0]
            died += bool(signals)
            print(f"{schedule} run {run}: exit codes {codes}" + (f", died of {signals}" if signals else ""), flush=True)
        print(f"{schedule}: a rank died in {died} of {args.runs} runs", flush=True)


if __name__ == "__main__":
    main()
