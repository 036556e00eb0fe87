"""Where a step's time goes: forward, backward and optimizer step per mode, against the floor, with a profile.

    python benchmarks/step_breakdown.py --config llama-4m@8x128

Each phase is timed on its own (the CPU runs everything synchronously, so
``perf_counter`` around ``model(x, y)``, ``loss.backward()`` and
``optimizer.step()`` measures it). A data-parallel path's backward minus the
floor's is the communication the backward could not hide (dpar waits for its
all-reduces inside the backward graph; DDP's reducer inside ``backward()``).
The modes take turns as in step_time_sweep.py. Then rank 0 records a
``torch.profiler`` trace of two steps of each mode (chrome trace, gzipped,
under ``benchmarks/results/profiles/``) and the table of the ops that took
the most time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from harness import RESULTS, revision, turns  # noqa: E402
from models import MODELS, batches  # noqa: E402
from step_time_sweep import Config, build, optimizer_for  # noqa: E402

MODES = ("alone_compiled", "ddp_compiled", "dpar_ddp", "fsdp2_eager", "dpar_fsdp")
PHASES = ("forward", "backward", "optimizer")


def phased_steps(step_model: Any, optimizer: torch.optim.Optimizer, data: list) -> list[dict[str, float]]:
    out = []
    for x, y in data:
        t0 = time.perf_counter()
        loss = step_model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        out.append({"forward": (t1 - t0) * 1e3, "backward": (t2 - t1) * 1e3, "optimizer": (t3 - t2) * 1e3})
    return out


def run_rank(rank: int, world_size: int, config: Config, args: argparse.Namespace) -> dict[str, Any]:
    torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    torch._inductor.config.compile_threads = 1
    torch._dynamo.config.cache_size_limit = 64
    spec = MODELS[config.model]
    data = batches(spec, config.rows, config.seq, args.warmup + args.steps, seed=args.seed + rank)
    steppers = {}
    for mode in args.modes:
        torch.manual_seed(args.seed)
        model = spec.build()
        step_model = build(mode, model, "inductor")
        optimizer = optimizer_for(mode, model, "inductor", 1e-3)
        phased_steps(step_model, optimizer, data[: args.warmup])
        steppers[mode] = (step_model, optimizer)
    phases: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    for _, mode, window in turns(args.modes, args.rounds, args.steps, args.warmup):
        phases[mode] += phased_steps(*steppers[mode], data[window])
    tops: dict[str, list[dict[str, Any]]] = {}
    for mode, (step_model, optimizer) in steppers.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            phased_steps(step_model, optimizer, data[-2:])
        if rank == 0:
            out = args.profiles / f"{config}_{mode}.json.gz"
            out.parent.mkdir(parents=True, exist_ok=True)
            trace = Path(str(out).removesuffix(".gz"))
            prof.export_chrome_trace(str(trace))
            out.write_bytes(gzip.compress(trace.read_bytes()))
            trace.unlink()
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
            tops[mode] = [
                {"name": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / 2, "calls_per_step": e.count / 2}
                for e in events
            ]
    return {"phases": phases, "tops": tops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama-4m@8x128", help="MODEL@ROWSxSEQ per rank")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="ops listed per mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--profiles", type=Path, default=RESULTS / "profiles")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_breakdown.json")
    args = parser.parse_args()
    config = Config.parse(args.config)
    start = time.perf_counter()
    ranks = run_ranks(run_rank, 2, config, args, timeout_s=args.timeout_s)
    floor = "alone_compiled"
    median = {
        mode: {p: statistics.median(s[p] for s in ranks[0]["phases"][mode]) for p in PHASES} for mode in args.modes
    }
    print(f"\n{config}, 2 gloo ranks x 1 thread, Inductor, AdamW; rank 0's medians (ms):\n")
    print("| mode | forward | backward | optimizer | step | backward - floor's |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, m in median.items():
        exposed = m["backward"] - median[floor]["backward"] if floor in median else float("nan")
        print(f"| {mode} | {m['forward']:.1f} | {m['backward']:.1f} | {m['optimizer']:.1f} | "
              f"{sum(m.values()):.1f} | {exposed:+.1f} |")
    for mode, top in ranks[0]["tops"].items():
        print(f"\n{mode}: ops by self time per step (torch.profiler, rank 0)")
        for e in top:
            print(f"  {e['self_ms_per_step']:8.2f} ms  {e['calls_per_step']:6.0f} calls  {e['name'][:90]}")
    record = {
        "benchmark": "step_breakdown", "config": str(config), "torch": torch.__version__,
        "dpar_revision": revision(), "wall_s": time.perf_counter() - start,
        "median_ms": median, "rank0": ranks[0],
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.out} and the traces under {args.profiles}")


if __name__ == "__main__":
    main()
