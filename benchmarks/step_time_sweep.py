"""Step time of dpar ddp and fsdp against eager and compiled DDP / FSDP2, swept over model size and tokens per rank.

    python benchmarks/step_time_sweep.py                                  # the whole sweep, Inductor
    python benchmarks/step_time_sweep.py --configs llama-4m@8x128 --compiler aot_eager

Each config (``model@rowsxseq``: rows and tokens per row on each rank) runs in
fresh gloo ranks, 2 ranks of one thread on the 2 cores. Every mode starts from
the same weights and trains on the same batches with AdamW; after the warm-up
(compilation) the modes take turns, ``rounds`` turns of ``steps / rounds``
steps each, so that load from other users of the machine lands on all of them
alike, and each turn gives every mode a median: the spread reported is the
lowest and highest of those per-turn ratios, each taken within one turn.

``alone_*`` are the floor: the same step on each rank with no communication at
all (both ranks still run at once, sharing the cores as the others do);
``alone_compiled`` compiles the model and the optimizer's step. No
data-parallel path can beat the lower of the two here. ``fsdp2_compiled`` trains in ranks
of its own, in turns with a fresh ``fsdp2_eager`` that relates it to the
others: compiling the FSDP2 root marks the model's forward skipped for the
whole process (its hooks are ``torch._dynamo.disable``d), which would leave
every model compiled after it running eagerly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dpar

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from harness import RESULTS, revision, timed_steps, turns  # noqa: E402
from models import MODELS, batches  # noqa: E402

WORLD_SIZE = 2  # the CPU machines have 2 cores: one rank per core
SHARED = ("alone_eager", "alone_compiled", "ddp_eager", "ddp_compiled", "dpar_ddp", "fsdp2_eager", "dpar_fsdp")
ISOLATED = ("fsdp2_eager", "fsdp2_compiled")
FAMILIES = {  # dpar's mode -> the torch paths it replaces
    "dpar_ddp": ("ddp_eager", "ddp_compiled"),
    "dpar_fsdp": ("fsdp2_eager", "fsdp2_compiled"),
}
DEFAULT_CONFIGS = ("gpt-0.8m@8x64", "llama-4m@8x64", "llama-4m@8x128", "llama-25m@4x128", "llama-25m@8x128")


@dataclasses.dataclass(frozen=True)
class Config:
    model: str
    rows: int
    seq: int

    @classmethod
    def parse(cls, text: str) -> Config:
        model, _, shape = text.partition("@")
        rows, _, seq = shape.partition("x")
        if model not in MODELS or not rows.isdigit() or not seq.isdigit():
            raise SystemExit(f"config {text!r} is not MODEL@ROWSxSEQ with MODEL one of {sorted(MODELS)}")
        return cls(model, int(rows), int(seq))

    def __str__(self) -> str:
        return f"{self.model}@{self.rows}x{self.seq}"


def build(mode: str, model: nn.Module, compiler: str) -> nn.Module:
    """``model`` wrapped, sharded or compiled as ``mode`` wants; the optimizer takes ``model.parameters()`` after."""
    if mode == "alone_eager":
        return model
    if mode == "alone_compiled":
        return torch.compile(model, backend=compiler)
    if mode.startswith("ddp"):
        ddp = DistributedDataParallel(model)
        return torch.compile(ddp, backend=compiler) if mode == "ddp_compiled" else ddp
    if mode.startswith("fsdp2"):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return torch.compile(model, backend=compiler) if mode == "fsdp2_compiled" else model
    strategy = mode.removeprefix("dpar_")
    if strategy != "ddp":
        dpar.parallelize(model, strategy=strategy)
    return torch.compile(model, backend="dpar", options={"compiler": compiler})


def optimizer_for(mode: str, model: nn.Module, compiler: str, lr: float) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters (after ``build``); the compiled floor compiles its step too, as
    dpar does its own (torch's modes step eagerly, as their users' code does)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if mode == "alone_compiled":
        optimizer.step = torch.compile(optimizer.step, backend=compiler)  # type: ignore[method-assign]
    return optimizer


def run_rank(rank: int, world_size: int, config: Config, modes: tuple[str, ...], args: argparse.Namespace) -> dict:
    """Warm every mode up, then time them in turns; per mode, the per-turn step times and the last loss."""
    torch._dynamo.config.optimize_ddp = "ddp_optimizer"  # compiled DDP splits its graph at bucket boundaries
    torch._inductor.config.compile_threads = 1
    torch._dynamo.config.cache_size_limit = 64  # one model per mode, each compiled once
    spec = MODELS[config.model]
    data = batches(spec, config.rows, config.seq, args.warmup + args.steps, seed=args.seed + rank)
    steppers = {}
    warmup_s = {}
    for mode in modes:
        torch.manual_seed(args.seed)
        model = spec.build()
        step_model = build(mode, model, args.compiler)
        optimizer = optimizer_for(mode, model, args.compiler, args.lr)
        start = time.perf_counter()
        timed_steps(step_model, optimizer, data[: args.warmup])
        warmup_s[mode] = time.perf_counter() - start
        steppers[mode] = (step_model, optimizer)
    per_mode: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    losses: dict[str, float] = {}
    for _, mode, window in turns(modes, args.rounds, args.steps, args.warmup):
        times, losses[mode] = timed_steps(*steppers[mode], data[window])
        per_mode[mode].append(times)
    return {"turns": per_mode, "final_loss": losses, "warmup_s": warmup_s}


def measure(config: Config, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Rank 0's per-turn medians of every mode; fsdp2_compiled's are scaled into the shared ranks' time."""
    shared = run_ranks(run_rank, WORLD_SIZE, config, SHARED, args, timeout_s=args.timeout_s)
    isolated = run_ranks(run_rank, WORLD_SIZE, config, ISOLATED, args, timeout_s=args.timeout_s)
    modes: dict[str, dict[str, Any]] = {}
    for source, names in ((shared, SHARED), (isolated, ("fsdp2_compiled",))):
        for mode in names:
            turn_medians = [statistics.median(t) for t in source[0]["turns"][mode]]
            modes[mode] = {
                "turn_median_ms": turn_medians,
                "median_ms": statistics.median(x for t in source[0]["turns"][mode] for x in t),
                "median_ms_rank1": statistics.median(x for t in source[1]["turns"][mode] for x in t),
                "final_loss": [r["final_loss"][mode] for r in source],
                "warmup_s": source[0]["warmup_s"][mode],
            }
    # Turn by turn, fsdp2_compiled / its own fsdp2_eager, times the shared ranks' fsdp2_eager.
    bridge = [statistics.median(t) for t in isolated[0]["turns"]["fsdp2_eager"]]
    compiled = modes["fsdp2_compiled"]
    compiled["reference_fsdp2_eager_turn_median_ms"] = bridge
    compiled["turn_median_ms"] = [
        c / b * s for c, b, s in zip(compiled["turn_median_ms"], bridge, modes["fsdp2_eager"]["turn_median_ms"])
    ]
    compiled["median_ms"] = statistics.median(compiled["turn_median_ms"])
    return modes


def ratios(modes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each dpar mode: its time over the best torch path's, the turns' spread, and its floor's ratio."""
    out = {}
    for mine, anchors in FAMILIES.items():
        best = min(anchors, key=lambda a: modes[a]["median_ms"])
        per_turn = [m / b for m, b in zip(modes[mine]["turn_median_ms"], modes[best]["turn_median_ms"])]
        floor = min(("alone_eager", "alone_compiled"), key=lambda a: modes[a]["median_ms"])
        out[mine] = {
            "best_torch": best,
            "ratio": modes[mine]["median_ms"] / modes[best]["median_ms"],
            "ratio_per_turn": per_turn,
            "floor": floor,
            "floor_ratio": modes[floor]["median_ms"] / modes[best]["median_ms"],
        }
    return out


def print_table(results: dict[str, Any]) -> None:
    print(
        "\n| config | params | floor ms | DDP eager | DDP compiled | dpar ddp | dpar/best (spread) "
        "| FSDP2 eager | FSDP2 compiled | dpar fsdp | dpar/best (spread) | floor/best DDP |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, entry in results.items():
        m, r = entry["modes"], entry["ratios"]

        def cell(mode: str) -> str:
            return f"{m[mode]['median_ms']:.0f}"

        def ratio(mine: str) -> str:
            turns = r[mine]["ratio_per_turn"]
            return f"{r[mine]['ratio']:.2f} ({min(turns):.2f}-{max(turns):.2f})"

        print(
            f"| {name} | {entry['parameters'] / 1e6:.1f}M | {cell(r['dpar_ddp']['floor'])} | {cell('ddp_eager')} | "
            f"{cell('ddp_compiled')} | {cell('dpar_ddp')} | {ratio('dpar_ddp')} | {cell('fsdp2_eager')} | "
            f"{cell('fsdp2_compiled')} | {cell('dpar_fsdp')} | {ratio('dpar_fsdp')} | "
            f"{r['dpar_ddp']['floor_ratio']:.2f} |"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="MODEL@ROWSxSEQ per rank")
    parser.add_argument("--compiler", choices=("aot_eager", "inductor"), default="inductor")
    parser.add_argument("--steps", type=int, default=9, help="measured steps per mode")
    parser.add_argument("--rounds", type=int, default=3, help="turns the modes take, steps / rounds steps each")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first, compilation included")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="fail (and kill the ranks) after this")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_time_sweep.json")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps % args.rounds:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --rounds ({args.rounds})")
    args.configs = [Config.parse(c) for c in args.configs]
    return args


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    results: dict[str, Any] = {}
    for config in args.configs:
        modes = measure(config, args)
        parameters = sum(p.numel() for p in MODELS[config.model].build().parameters())
        results[str(config)] = {"parameters": parameters, "modes": modes, "ratios": ratios(modes)}
        print_table({str(config): results[str(config)]})
    print(f"\n{WORLD_SIZE} gloo ranks x 1 thread, AdamW, compiled with {args.compiler}, rank 0's medians:")
    print_table(results)
    record = {
        "benchmark": "step_time_sweep",
        "compiler": args.compiler,
        "world_size": WORLD_SIZE,
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "dpar_revision": revision(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "wall_s": time.perf_counter() - start,
        "configs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out} after {record['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
