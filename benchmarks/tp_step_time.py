"""Step time, peak memory and communication of a GPT under dpar's tensor parallel, on 2 gloo ranks.

    python benchmarks/tp_step_time.py    # about 2 minutes

Modes, every one from the same weights on the same batches with AdamW:
``single`` (the model compiled with aot_eager, no dpar: each rank trains its
own full copy on the full batch, as one device would), ``dpar_ddp`` (each rank
half of the batch), ``dpar_tp`` and ``dpar_tp_sp`` (``strategy="tp"`` without
and with ``sequence_parallel``: both ranks see the full batch, each holds half
of every split layer). Ratios are against ``single`` measured in the same
processes, in turns, so load on the machine hits every mode alike.

Collectives come from the last warm-up step under ``torch.profiler``; bytes
per step are full size (an all-gather's output, a reduce-scatter's input).
Activation memory comes from the compiled graphs (``dpar inspect``'s liveness
walk over the forward, then the backward): the peak of live graph tensors and
what the forward saves for the backward, per rank. The profiler's live bytes
are recorded too, but on gloo they drift with the number of collectives (the
live bytes at step start differ between ranks and grow by tens of MB with
sequence parallel's 47 collectives), so they are not the comparison. The Megatron formula: per step tp moves
``2(1 + 2L)`` activations of B·T·C values in all-reduces (embedding, then
attention and MLP per block, forward and backward); sequence parallel moves the
same bytes as a reduce-scatter plus an all-gather each.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, record_function

import dpar
from dpar.compiler import registry
from dpar.compiler.memory import step_peak

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from gpt import GPT, GPTConfig, get_batch, load_corpus  # noqa: E402
from harness import check_schedule, revision, step_time_parser, timed_steps, write_record  # noqa: E402
from peak_memory import _live_bytes  # noqa: E402
from sharded_step_time import measured_collectives  # noqa: E402

WORLD_SIZE = 2
MODES = ("single", "dpar_ddp", "dpar_tp", "dpar_tp_sp")
CONFIG = GPTConfig(n_layer=4, n_head=8, n_embd=256, fused_qkv=False)  # separate q/k/v: heads split

Batch = tuple[torch.Tensor, torch.Tensor]


def build(mode: str, args: argparse.Namespace, example: torch.Tensor) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)
    model = GPT(CONFIG)
    if mode == "single":
        step_model = torch.compile(model, backend="aot_eager")
    else:
        if mode == "dpar_ddp":
            dpar.parallelize(model, strategy="ddp")
        else:
            mesh = init_device_mesh("cpu", (WORLD_SIZE,))
            dpar.parallelize(
                model, strategy="tp", mesh=mesh, example_inputs=(example,), sequence_parallel=mode == "dpar_tp_sp"
            )
        step_model = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    return step_model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def local_batches(mode: str, batches: list[Batch]) -> list[Batch]:
    """ddp's ranks split the batch; every other mode trains on all of it."""
    if mode != "dpar_ddp":
        return batches
    rank = dist.get_rank()
    return [(x.chunk(WORLD_SIZE)[rank], y.chunk(WORLD_SIZE)[rank]) for x, y in batches]


def graph_activation_peak(graphs: Sequence[registry.CompiledGraph]) -> int:
    """Peak bytes of live graph tensors over a step on this rank (parameters and views of them
    not counted), from the one forward/backward pair among ``graphs``."""
    (forward,) = [g.graph for g in graphs if g.label == "forward graph"]
    (backward,) = [g.graph for g in graphs if g.label.startswith("backward graph")]
    return int(step_peak([(forward, backward)]).total)


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    data = load_corpus()
    batches = [get_batch(data, args.batch_size, CONFIG.block_size, generator) for _ in range(args.warmup + args.steps)]
    trainers, results = {}, {}
    for mode in MODES:
        gc.collect()
        window = f"measured step ({mode})"
        mine = local_batches(mode, batches)
        with registry.recording() as graphs, profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True
        ) as prof:
            trainers[mode] = build(mode, args, batches[0][0])
            timed_steps(*trainers[mode], mine[: args.warmup - 1])
            with record_function(window):
                timed_steps(*trainers[mode], mine[args.warmup - 1 : args.warmup])
        at_start, peak = _live_bytes(prof, window)
        results[mode] = {
            "at_step_start_bytes": at_start,
            "peak_bytes": peak,
            "collectives": measured_collectives(prof, window, world_size),
            "registry": registry.communication_per_step(graphs) if mode != "single" else {},
            "activation_peak": graph_activation_peak(graphs) if mode != "single" else None,
            "step_ms": [],
        }
    per_turn = args.steps // args.rounds
    for turn in range(args.rounds):
        first = args.warmup + turn * per_turn
        for mode, (step_model, optimizer) in trainers.items():
            times, results[mode]["final_loss"] = timed_steps(
                step_model, optimizer, local_batches(mode, batches[first : first + per_turn])
            )
            results[mode]["step_ms"] += times
    return results


def report(ranks: list[dict[str, dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    median = {m: [statistics.median(r[m]["step_ms"]) for r in ranks] for m in MODES}
    peak = {m: max(r[m]["peak_bytes"] for r in ranks) for m in MODES}
    activation = args.batch_size * CONFIG.block_size * CONFIG.n_embd * 4
    exchanges = 2 * (1 + 2 * CONFIG.n_layer)
    print(
        f"\nGPT {CONFIG}, {WORLD_SIZE} gloo ranks x 1 thread, global batch {args.batch_size}, AdamW, "
        f"{args.steps} measured steps in {args.rounds} turns after {args.warmup} warm-up, aot_eager\n"
    )
    print(
        "| mode | step ms r0 | step ms r1 | x single | activation peak MiB/rank | x dpar_tp | "
        "profiler peak MiB | collectives/step | MB/step | final loss r0 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    modes: dict[str, Any] = {}
    for mode in MODES:
        comm = ranks[0][mode]["collectives"]
        full = sum(c["bytes"] for c in comm.values())
        kinds = ", ".join(f"{k} {c['count']}" for k, c in comm.items()) or "none"
        ratio, mem_ratio = median[mode][0] / median["single"][0], peak[mode] / peak["single"]
        graph = ranks[0][mode]["activation_peak"]
        graph_mib = f"{graph / 2**20:.2f}" if graph else ""
        graph_ratio = f"{graph / ranks[0]['dpar_tp']['activation_peak']:.3f}" if graph else ""
        print(
            f"| {mode} | {median[mode][0]:.1f} | {median[mode][1]:.1f} | {ratio:.2f} | {graph_mib} | "
            f"{graph_ratio} | {peak[mode] / 2**20:.2f} | {kinds} | {full / 1e6:.2f} | {ranks[0][mode]['final_loss']:.5f} |"
        )
        modes[mode] = {
            "median_step_ms_per_rank": median[mode],
            "ratio_to_single": ratio,
            "graph_activation_peak_bytes_rank0": ranks[0][mode]["activation_peak"],
            "profiler_peak_bytes_max_over_ranks": peak[mode],
            "profiler_peak_ratio_to_single": mem_ratio,
            "at_step_start_bytes_per_rank": [r[mode]["at_step_start_bytes"] for r in ranks],
            "collectives_per_step": comm,
            "registry": ranks[0][mode]["registry"],
            "final_loss_per_rank": [r[mode]["final_loss"] for r in ranks],
            "step_ms_per_rank": [r[mode]["step_ms"] for r in ranks],
        }
    for mode, kind in (("dpar_tp", "all_reduce"), ("dpar_tp_sp", "reduce_scatter")):
        reg = modes[mode]["registry"]
        moved = {k: c["bytes"] * (WORLD_SIZE if k == "all_gather" else 1) for k, c in reg.items()}
        verdict = "equals" if moved[kind] == exchanges * activation else "DIFFERS FROM"
        print(
            f"\n{mode}: " + ", ".join(f"{k} {reg[k]['count']}x {moved[k]} B" for k in reg) + f" (full size); its {kind} "
            f"bytes {verdict} the Megatron formula {exchanges} x B·T·C·4 = {exchanges * activation} B"
        )
    return {
        "benchmark": "tp_step_time",
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "threads_per_rank": 1,
        "model": dataclasses.asdict(CONFIG),
        "global_batch": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "activation_bytes": activation,
        "megatron_exchanges_per_step": exchanges,
        "memory_method": "torch.profiler profile_memory: running sum of allocator events, last warm-up step",
        "torch": torch.__version__,
        "dpar_revision": revision(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "modes": modes,
    }


def main() -> None:
    parser = step_time_parser(__doc__.split("\n\n")[0], "single-process", "tp_step_time")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured steps first; compiles, the last is profiled")
    args = parser.parse_args()
    check_schedule(args, 2, "the first step compiles, the last is profiled")
    start = time.perf_counter()
    record = report(run_ranks(run_rank, WORLD_SIZE, args, timeout_s=args.timeout_s), args)
    record["wall_s"] = time.perf_counter() - start
    print(f"wrote {write_record(record, 'tp_step_time', args)} after {record['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
