"""dpar ddp's gradient buckets planned from cost, against fixed bucket sizes, on 2 gloo ranks.

    python benchmarks/bucket_plan.py                       # llama-4m and llama-25m, 8x128 tokens a rank

Modes: ``cost`` (no ``bucket_cap_mb``: the plan of compiler/passes/bucket_schedule.py
for the "cpu" preset) and ``cap:X`` (DDP's greedy buckets of X MiB; ``cap:1024`` is
one bucket, all-reduced after the whole backward). Every mode compiles with Inductor
(the optimizer step in the graph too), starts from the same weights and trains on the
same batches; they take turns as in step_time_sweep.py. The gap between one bucket
and the best plan is the communication that hides under the backward: the "cpu"
preset's ``overlap`` is that gap over the all-reduce time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from harness import RESULTS, revision, timed_steps, turns  # noqa: E402
from models import MODELS, batches  # noqa: E402
from step_time_sweep import Config  # noqa: E402

MODES = ("cost", "cap:1024", "cap:25", "cap:12", "cap:4")


def run_rank(rank: int, world_size: int, config: Config, args: argparse.Namespace) -> dict[str, Any]:
    from dpar.compiler.registry import recording

    torch._inductor.config.compile_threads = 1
    torch._dynamo.config.cache_size_limit = 64
    spec = MODELS[config.model]
    data = batches(spec, config.rows, config.seq, args.warmup + args.steps, seed=args.seed + rank)
    steppers, buckets = {}, {}
    for mode in args.modes:
        torch.manual_seed(args.seed)
        model = spec.build()
        options = {} if mode == "cost" else {"bucket_cap_mb": float(mode.removeprefix("cap:"))}
        step_model = torch.compile(model, backend="dpar", options=options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with recording() as graphs:
            timed_steps(step_model, optimizer, data[: args.warmup])
        backward = next(g for g in graphs if g.label == "backward graph (sync)")
        buckets[mode] = [c.bytes for c in backward.collectives if c.kind == "all_reduce"]
        steppers[mode] = (step_model, optimizer)
    step_ms: dict[str, list[float]] = {mode: [] for mode in args.modes}
    for _, mode, window in turns(args.modes, args.rounds, args.steps, args.warmup):
        step_ms[mode] += timed_steps(*steppers[mode], data[window])[0]
    return {"step_ms": step_ms, "bucket_bytes": buckets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["llama-4m@8x128", "llama-25m@8x128"])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "bucket_plan.json")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps % args.rounds:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --rounds ({args.rounds})")
    start = time.perf_counter()
    results = {}
    print("| config | mode | buckets (MiB, in issue order) | step ms (median, rank 0) | x cost plan |")
    print("|---|---|---|---:|---:|")
    for text in args.configs:
        config = Config.parse(text)
        rank0 = run_ranks(run_rank, 2, config, args, timeout_s=args.timeout_s)[0]
        medians = {mode: statistics.median(ms) for mode, ms in rank0["step_ms"].items()}
        for mode in args.modes:
            sizes = ", ".join(f"{b / 2**20:.1f}" for b in rank0["bucket_bytes"][mode])
            ratio = medians[mode] / medians["cost"] if "cost" in medians else float("nan")
            print(f"| {config} | {mode} | {sizes} | {medians[mode]:.1f} | {ratio:.3f} |")
        results[str(config)] = {"median_step_ms": medians, **rank0}
    record = {"benchmark": "bucket_plan", "torch": torch.__version__, "dpar_revision": revision(),
              "wall_s": time.perf_counter() - start, "configs": results}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out} after {record['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
