"""Training step time of one GPT under eager DDP, compiled DDP and dpar, on 2 gloo ranks.

    python benchmarks/ddp_step_time.py                      # compiled modes use aot_eager
    python benchmarks/ddp_step_time.py --compiler inductor  # about a minute of compiling per mode on CPU

Every mode starts from the same weights, trains on the same batches (rank r
draws from a generator seeded with seed + r), with AdamW and the same bucket
cap. Warm-up steps (compilation, DDP's bucket rebuild) are not measured; then
the modes take turns at the measured steps, so that load from other users of
the machine hits all of them alike. Each rank times its own steps without a
barrier, as a training loop runs; the table reports rank 0's median. The final
loss column shows the modes computed the same training run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from dpar.compiler.registry import CompiledGraph, communication_per_step, recording

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
from gpt import GPT, GPTConfig, get_batch, load_corpus  # noqa: E402
from harness import check_schedule, revision, step_time_parser, timed_steps, write_record  # noqa: E402  (beside this file)

WORLD_SIZE = 2  # the CPU machines have 2 cores: one rank per core
MODES = ("ddp_eager", "ddp_compiled", "dpar")


@dataclasses.dataclass(frozen=True)
class ModeResult:
    step_ms: list[float]  # measured steps, after warm-up
    first_step_ms: float  # includes compilation
    collectives_per_step: int
    bytes_per_step: int
    final_loss: float

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def iqr_ms(self) -> float:
        """Interquartile range: how much a shared machine's load moved the steps around."""
        q1, _, q3 = statistics.quantiles(self.step_ms, n=4)
        return q3 - q1


def ddp_communication(ddp: DistributedDataParallel) -> tuple[int, int]:
    """(all-reduces, bytes) per step: one all-reduce per bucket of DDP's C++ reducer.

    Read from the reducer's logging data after warm-up: after the first
    backward DDP rebuilds its buckets in the order gradients became ready, and
    the rebuilt sizes are what every later step reduces. Since bucket_cap_mb is
    passed explicitly, torch 2.13 caps the first bucket at bucket_cap_mb too
    (its 1 MiB first bucket applies only to the default), as dpar does.
    Compiled DDP keeps the same reducer: DDPOptimizer only splits the graph at
    these bucket boundaries.
    """
    logging_data = ddp._get_ddp_logging_data()
    sizes = logging_data.get("rebuilt_bucket_sizes") if logging_data.get("has_rebuilt_buckets") else None
    sizes = sizes or logging_data["bucket_sizes"]
    buckets = [int(s) for s in str(sizes).split(",") if s.strip()]
    return len(buckets), sum(buckets)


def dpar_communication(graphs: Sequence[CompiledGraph]) -> tuple[int, int]:
    """(collectives, bytes) per step as dpar's passes inserted them; each rank compiles one dpar model."""
    per_kind = communication_per_step(graphs).values()
    return sum(c["count"] for c in per_kind), sum(c["bytes"] for c in per_kind)


@dataclasses.dataclass
class Trainer:
    """One mode's model, ready to step."""

    step_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    ddp: DistributedDataParallel | None

    def train(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], float]:
        return timed_steps(self.step_model, self.optimizer, batches)

    def communication(self, graphs: Sequence[CompiledGraph]) -> tuple[int, int]:
        return dpar_communication(graphs) if self.ddp is None else ddp_communication(self.ddp)


def build(mode: str, args: argparse.Namespace) -> Trainer:
    """A GPT from the same seed as every other mode, wrapped as ``mode`` wants."""
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if mode == "dpar":
        options = {"compiler": args.compiler, "bucket_cap_mb": args.bucket_cap_mb}
        return Trainer(torch.compile(model, backend="dpar", options=options), optimizer, None)
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    step_model = torch.compile(ddp, backend=args.compiler) if mode == "ddp_compiled" else ddp
    return Trainer(step_model, optimizer, ddp)


def run_rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """Warm every mode up (compiling it), then time ``steps`` steps of each, in ``rounds`` turns.

    The modes take turns of steps / rounds steps each, so a neighbour's burst
    of CPU load on a shared machine (which doubles a step's time here) spreads
    over all of them instead of landing on one.
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE)
    )
    torch.set_num_threads(1)  # two ranks on two cores: more threads only contend
    torch._dynamo.config.optimize_ddp = "ddp_optimizer"  # split compiled DDP at bucket boundaries
    torch._inductor.config.compile_threads = 1
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        config = GPTConfig()
        generator = torch.Generator().manual_seed(args.seed + rank)
        data = load_corpus()
        batches = [
            get_batch(data, args.batch_size, config.block_size, generator)
            for _ in range(args.warmup + args.steps)
        ]
        per_turn = args.steps // args.rounds
        trainers = {mode: build(mode, args) for mode in args.modes}
        with recording() as graphs:  # the warm-up compiles
            first_step_ms = {mode: t.train(batches[: args.warmup])[0][0] for mode, t in trainers.items()}
        step_ms: dict[str, list[float]] = {mode: [] for mode in args.modes}
        final_loss: dict[str, float] = {}
        for turn in range(args.rounds):
            start = args.warmup + turn * per_turn
            for mode, trainer in trainers.items():
                times, final_loss[mode] = trainer.train(batches[start : start + per_turn])
                step_ms[mode] += times
        results = {}
        for mode, trainer in trainers.items():
            collectives, nbytes = trainer.communication(graphs)
            results[mode] = dataclasses.asdict(
                ModeResult(step_ms[mode], first_step_ms[mode], collectives, nbytes, final_loss[mode])
            )
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: argparse.Namespace) -> dict[int, dict[str, dict[str, Any]]]:
    """Every rank's results; a rank that fails, or ranks still running after the timeout, fail the run."""
    queue = mp.get_context("spawn").SimpleQueue()  # put() writes at once: nothing left unflushed at exit
    context = mp.start_processes(
        run_rank, args=(_free_port(), args, queue), nprocs=WORLD_SIZE, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + args.timeout_s
    results: dict[int, dict[str, dict[str, Any]]] = {}
    while not context.join(timeout=1.0):  # raises with the rank's traceback if one failed
        while not queue.empty():
            rank, result = queue.get()
            results[rank] = result
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"ranks still running after {args.timeout_s:.0f} s (a hang?); killed them")
    while not queue.empty():
        rank, result = queue.get()
        results[rank] = result
    return results


def report(results: dict[int, dict[str, dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table and return what the JSON file records."""
    rank0 = {mode: ModeResult(**results[0][mode]) for mode in args.modes}
    dpar_ms = rank0["dpar"].median_ms if "dpar" in rank0 else None
    print(
        f"GPT {GPTConfig()}, {WORLD_SIZE} gloo ranks x 1 thread, batch {args.batch_size}/rank, "
        f"{args.steps} measured steps in {args.rounds} turns after {args.warmup} warm-up, "
        f"bucket cap {args.bucket_cap_mb} MB, compiled with {args.compiler}"
    )
    header = (
        f"{'mode':<14}{'median ms':>10}{'IQR ms':>8}{'rank 1 ms':>10}{'x dpar':>8}"
        f"{'colls/step':>11}{'MB/step':>9}{'final loss':>11}"
    )
    print(header)
    print("-" * len(header))
    modes: dict[str, Any] = {}
    for mode, result in rank0.items():
        rank1_ms = statistics.median(results[1][mode]["step_ms"])
        ratio = result.median_ms / dpar_ms if dpar_ms else float("nan")
        print(
            f"{mode:<14}{result.median_ms:>10.1f}{result.iqr_ms:>8.1f}{rank1_ms:>10.1f}{ratio:>8.2f}"
            f"{result.collectives_per_step:>11}{result.bytes_per_step / 1e6:>9.2f}{result.final_loss:>11.4f}"
        )
        modes[mode] = {
            "median_step_ms": result.median_ms,
            "iqr_step_ms": result.iqr_ms,
            "median_step_ms_rank1": rank1_ms,
            "ratio_to_dpar": ratio,
            "collectives_per_step": result.collectives_per_step,
            "bytes_per_step": result.bytes_per_step,
            "first_step_ms": result.first_step_ms,
            "final_loss": result.final_loss,
            "step_ms_rank0": result.step_ms,
        }
    return {
        "benchmark": "ddp_step_time",
        "compiler": args.compiler,
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "threads_per_rank": 1,
        "model": dataclasses.asdict(GPTConfig()),
        "batch_size_per_rank": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "bucket_cap_mb": args.bucket_cap_mb,
        "torch": torch.__version__,
        "dpar_revision": revision(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "modes": modes,
    }


def parse_args() -> argparse.Namespace:
    parser = step_time_parser(__doc__.split("\n\n")[0], "compiled DDP", "ddp_step_time")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first, compilation included")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    check_schedule(args, 1, "the first step compiles")
    out = write_record(report(run_ranks(args), args), "ddp_step_time", args)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
