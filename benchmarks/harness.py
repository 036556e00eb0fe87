"""What the benchmarks share: their command line, the revision measured, the results file, the live-bytes
reading of a memory profile and the calibration of this machine (α, β, matmul FLOP/s, copy bandwidth)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def revision() -> str:
    """The commit measured; "-dirty" when the working tree had uncommitted changes."""
    described = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return described.stdout.strip() or "unknown"


def step_time_parser(description: str, anchor: str, stem: str) -> argparse.ArgumentParser:
    """The options every step-time benchmark takes; ``anchor`` is the compiled torch mode compared."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--compiler",
        choices=("aot_eager", "inductor"),
        default="aot_eager",
        help=f"backend of {anchor}, and dpar's inner compiler",
    )
    parser.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    parser.add_argument("--rounds", type=int, default=5, help="turns the modes take, steps / rounds steps each")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="fail (and kill the ranks) after this")
    parser.add_argument("--out", type=Path, help=f"JSON file (default benchmarks/results/{stem}[_inductor].json)")
    return parser


def check_schedule(args: argparse.Namespace, min_warmup: int, why: str) -> None:
    if args.warmup < min_warmup:
        raise SystemExit(f"--warmup must be at least {min_warmup}: {why}")
    if args.rounds < 1 or args.steps % args.rounds:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --rounds ({args.rounds})")


def write_record(record: dict[str, Any], stem: str, args: argparse.Namespace) -> Path:
    suffix = "" if args.compiler == "aot_eager" else f"_{args.compiler}"
    out = args.out or RESULTS / f"{stem}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out


def timed_steps(
    step_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[float], float]:
    """Per-step wall times (ms) and the last loss; no barrier, as a training loop runs."""
    step_ms = []
    for x, y in batches:
        start = time.perf_counter()
        loss = step_model(x, y)
        if loss.requires_grad:  # a pipeline's step runs its backward itself
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_ms.append((time.perf_counter() - start) * 1e3)
    return step_ms, loss.item()


def turns(modes: Sequence[str], rounds: int, steps: int, warmup: int) -> Iterator[tuple[int, str, slice]]:
    """(turn, mode, its batches) for ``rounds`` turns of ``steps / rounds`` steps after the warm-up.

    Every mode runs once a turn, on the same batches as the others, so that a neighbour's burst of
    load lands on all of them alike; each turn starts one mode further on, so no mode always runs
    right after the same other one (a mode after a larger one was measured a few percent slower).
    """
    per_turn = steps // rounds
    for turn in range(rounds):
        first = warmup + turn * per_turn
        shift = turn % len(modes)
        for mode in [*modes[shift:], *modes[:shift]]:
            yield turn, mode, slice(first, first + per_turn)


def live_bytes(prof: Any, window: str) -> tuple[int, int]:
    """(live bytes as ``window`` starts, their peak inside it), from a ``profile_memory=True`` profile.

    c10's CPU allocator reports every allocation and free as a ``[memory]`` event with its size
    (frees negative, also of tensors allocated before the profile began); their running sum is the
    bytes of live tensor storage. With the profile started before the model exists, the first
    figure is what the process holds at the window's start; with it started just before the
    window, it is 0 and the second is the peak above what was live at the start.
    """
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    (span,) = [e for e in events if e.name() == window]
    live = at_start = peak = 0
    for e in events:
        if e.name() != "[memory]":
            continue
        if e.start_ns() > span.end_ns():
            break
        live += e.nbytes()
        if e.start_ns() < span.start_ns():
            at_start = peak = live
        else:
            peak = max(peak, live)
    return at_start, peak


def median_seconds(fn: Callable[[], Any], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def calibrate(matmul: int = 512, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """This machine as one rank sees it: α, β of a gloo all-reduce (t = 2α + Bβ at N = 2, fitted from
    two sizes, in wall time; needs an initialised 2-rank process group), a ``matmul``² fp32 matmul's
    FLOP/s and the bandwidth of a 16 MiB copy (bytes read + written per second), timed by ``clock``
    (``time.thread_time``: the CPU time of this thread, which a neighbour's load does not inflate), and
    the calling thread's seconds for a small all-reduce (``collective_host_seconds``)."""
    import torch.distributed as dist

    small, large = torch.ones(256), torch.ones(1 << 20)
    t_small = median_seconds(lambda: dist.all_reduce(small), 30)
    t_large = median_seconds(lambda: dist.all_reduce(large), 10)
    beta = max((t_large - t_small) / (large.nbytes - small.nbytes), 1e-15)
    alpha = max((t_small - small.nbytes * beta) / 2, 0.0)
    a, b = torch.randn(matmul, matmul), torch.randn(matmul, matmul)
    flops = 2 * matmul**3 / median_seconds(lambda: a @ b, 20, clock)
    big = torch.randn(1 << 22)
    bandwidth = 2 * big.nbytes / median_seconds(big.clone, 20, clock)
    return {"alpha": alpha, "link_bandwidth": 1 / beta, "flops": flops, "memory_bandwidth": bandwidth,
            "collective_host_seconds": collective_host_seconds(small)}


def collective_host_seconds(buffer: torch.Tensor, count: int = 20, repeats: int = 5) -> float:
    """The calling thread's CPU time for one functional all-reduce of ``buffer``: ``count`` issued back to back
    and waited for once done (after a sleep, as a step waits for a collective its compute has covered), the
    median over ``repeats``. See [Note: host work the graphs' kernels do not show] in compiler/costs.py."""
    import torch.distributed as dist

    functional, group = torch.ops._c10d_functional, dist.group.WORLD.group_name
    per_collective = []
    for _ in range(repeats):
        dist.barrier()
        began = time.thread_time()
        pending = [functional.all_reduce(buffer, "sum", group) for _ in range(count)]
        issued = time.thread_time() - began
        time.sleep(0.05)
        began = time.thread_time()
        for result in pending:
            functional.wait_tensor(result)
        per_collective.append((issued + time.thread_time() - began) / count)
    return statistics.median(per_collective)


def report_pairs(report: Any) -> list[tuple[Any, Any]]:
    """The report's (forward, backward) graphs per captured graph, as ``step_peak`` reads them (ddp: the
    backward variant that synchronises)."""
    graphs: dict[str, dict[str, Any]] = {}
    for view in report.graphs:
        prefix, _, label = view.label.rpartition(": ")
        graphs.setdefault(prefix, {})[label] = view.graph
    return [
        (g["forward graph"], g.get("backward graph (sync)", g.get("backward graph")))
        for g in graphs.values() if "forward graph" in g
    ]
