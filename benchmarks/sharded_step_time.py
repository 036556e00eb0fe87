"""Step time, peak memory and communication of one GPT under FSDP2 and dpar's sharded strategies, on 2 gloo ranks.

    python benchmarks/sharded_step_time.py                      # compiled modes use aot_eager (about 70 s)
    python benchmarks/sharded_step_time.py --compiler inductor  # minutes of compiling on CPU

Modes: ``fsdp2_eager`` (``fully_shard`` on every ``Block``, then the root),
``fsdp2_compiled`` (the same model under ``torch.compile``; if it fails the
error is recorded and the other modes go on), ``dpar_fsdp`` and ``dpar_zero2``
(``dpar.parallelize`` then ``torch.compile(backend="dpar")``). Every mode starts
from the same weights and trains on the same batches with AdamW.
fsdp2_compiled trains in a second pair of processes (``run_all`` says why).

Each rank builds the modes one after another, each inside its own
``torch.profiler`` session with ``profile_memory``: the session starts before
the model exists, so the running sum of allocator events is that mode's live
tensor bytes alone (peak_memory.py's measure, imported from there). The last
warm-up step is the measured window for memory and for the collectives (the
``gloo:*`` events, one per collective gloo runs). Then the modes take turns at
the measured steps, unprofiled, so that load from other users of the machine
hits all of them alike; each rank times its own steps without a barrier.

Bytes per step are full-size bytes, the convention of the "FSDP moves 3x the
parameter bytes" formula: an all-gather counts its output, a reduce-scatter its
input. gloo runs a reduce-scatter as an all-reduce of the full tensor, so it
shows up as ``gloo:all_reduce``.
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
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile, record_function

import dpar
from dpar.compiler import registry

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from gpt import GPT, Block, GPTConfig, get_batch, load_corpus  # noqa: E402
from harness import check_schedule, revision, step_time_parser, timed_steps, write_record  # noqa: E402
from peak_memory import _live_bytes  # noqa: E402

WORLD_SIZE = 2  # the CPU machines have 2 cores: one rank per core
MODES = ("fsdp2_eager", "fsdp2_compiled", "dpar_fsdp", "dpar_zero2")
FORMULA = {"dpar_fsdp": 3, "dpar_zero2": 2}  # parameter bytes moved per step (ANCHORS.md)
ITEMSIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2}  # profiler dtype names

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class Trainer:
    """One mode's model, ready to step."""

    step_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer

    def train(self, batches: Sequence[Batch]) -> tuple[list[float], float]:
        return timed_steps(self.step_model, self.optimizer, batches)


def build(mode: str, args: argparse.Namespace) -> Trainer:
    """A GPT from the same seed as every other mode, sharded and compiled as ``mode`` wants."""
    torch.manual_seed(args.seed)
    model: nn.Module = GPT(GPTConfig())
    if mode.startswith("fsdp2"):
        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module)
        fully_shard(model)
        step_model = torch.compile(model, backend=args.compiler) if mode == "fsdp2_compiled" else model
    else:
        dpar.parallelize(model, strategy=mode.removeprefix("dpar_"))
        step_model = torch.compile(model, backend="dpar", options={"compiler": args.compiler})
    return Trainer(step_model, torch.optim.AdamW(model.parameters(), lr=args.lr))


def measured_collectives(prof: profile, window: str, world_size: int) -> dict[str, dict[str, int]]:
    """Collectives gloo ran inside ``window``, by gloo's name: count and full-size bytes."""
    events = list(prof.profiler.kineto_results.events())
    (span,) = [e for e in events if e.name() == window]
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for e in events:
        if not e.name().startswith("gloo:") or not span.start_ns() <= e.start_ns() <= span.end_ns():
            continue
        numel = sum(int(torch.Size(shape).numel()) for shape in e.shapes())
        size = numel * ITEMSIZE[e.dtypes()[0]]
        kind = e.name().removeprefix("gloo:")
        counts[kind] += 1
        nbytes[kind] += size * world_size if kind == "all_gather" else size  # a gather's input is the shard
    return {kind: {"count": counts[kind], "bytes": nbytes[kind]} for kind in sorted(counts)}


def warm_up(mode: str, args: argparse.Namespace, batches: Sequence[Batch]) -> tuple[Trainer, dict[str, Any]]:
    """Build ``mode`` and run the warm-up steps (compilation included) under a profiler of its own.

    Returns the trainer and what the last warm-up step measured: its live
    tensor bytes at start and peak, its collectives, and for dpar what
    ``communication_per_step()`` reports.
    """
    gc.collect()  # earlier modes' garbage freed inside this session would read as negative bytes
    window = f"measured step ({mode})"
    start = time.perf_counter()
    with registry.recording() as graphs, profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True
    ) as prof:
        trainer = build(mode, args)
        first_ms = trainer.train(batches[:1])[0][0]
        trainer.train(batches[1:-1])
        with record_function(window):
            trainer.train(batches[-1:])
    at_start, peak = _live_bytes(prof, window)
    measured = {
        "first_step_ms": first_ms,
        "warmup_s": time.perf_counter() - start,
        "at_step_start_bytes": at_start,
        "peak_bytes": peak,
        "collectives": measured_collectives(prof, window, dist.get_world_size()),
    }
    if mode.startswith("dpar"):
        if not graphs:
            raise RuntimeError(f"{mode} compiled no dpar graph: did Dynamo reuse another mode's code?")
        measured["registry"] = registry.communication_per_step(graphs)
        by_graph: dict[str, Counter[str]] = {}
        for graph in graphs:
            for c in graph.collectives:
                full = c.bytes * (WORLD_SIZE if c.kind == "all_gather" else 1)
                by_graph.setdefault(graph.label, Counter())[c.kind] += full
        measured["registry_by_graph"] = {label: dict(kinds) for label, kinds in by_graph.items()}
    return trainer, measured


def run_rank(rank: int, world_size: int, args: argparse.Namespace, modes: list[str]) -> dict[str, dict[str, Any]]:
    """Warm every mode up (measuring memory and collectives), then time the steps in turns."""
    torch._inductor.config.compile_threads = 1
    config = GPTConfig()
    generator = torch.Generator().manual_seed(args.seed + rank)
    data = load_corpus()
    batches = [get_batch(data, args.batch_size, config.block_size, generator) for _ in range(args.warmup + args.steps)]
    trainers: dict[str, Trainer] = {}
    results: dict[str, dict[str, Any]] = {}
    for mode in modes:
        try:
            trainers[mode], results[mode] = warm_up(mode, args, batches[: args.warmup])
        except Exception as exc:
            if mode != "fsdp2_compiled":
                raise
            results[mode] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]}
    per_turn = args.steps // args.rounds
    for mode in trainers:
        results[mode]["step_ms"] = []
    for turn in range(args.rounds):
        first = args.warmup + turn * per_turn
        for mode, trainer in trainers.items():
            times, results[mode]["final_loss"] = trainer.train(batches[first : first + per_turn])
            results[mode]["step_ms"] += times
    return results


def run_all(args: argparse.Namespace) -> list[dict[str, dict[str, Any]]]:
    """Per rank, every mode's results; fsdp2_compiled comes from ranks of its own.

    FSDP2's hooks are ``torch._dynamo.disable``d, so compiling the root breaks
    the graph inside ``GPT.forward``'s loop over blocks, and Dynamo marks that
    code object skipped for the whole process: dpar models compiled before or
    after it would then run ``GPT.forward`` eagerly. So fsdp2_compiled trains
    in a second pair of processes, in turns with a fresh fsdp2_eager, whose
    step time relates it to the first pair's.
    """
    shared = [m for m in MODES if m != "fsdp2_compiled"]
    ranks = run_ranks(run_rank, WORLD_SIZE, args, shared, timeout_s=args.timeout_s)
    isolated = run_ranks(run_rank, WORLD_SIZE, args, ["fsdp2_eager", "fsdp2_compiled"], timeout_s=args.timeout_s)
    for mine, theirs in zip(ranks, isolated):
        mine["fsdp2_compiled"] = theirs["fsdp2_compiled"]
        mine["fsdp2_compiled"]["reference_fsdp2_eager"] = theirs["fsdp2_eager"]
    return ranks


def parameter_bytes() -> int:
    """Bytes of the full (unsharded) parameters; the tied embedding counts once."""
    return sum(p.numel() * p.element_size() for p in GPT(GPTConfig()).parameters())


def formula_check(mode: str, measured: dict[str, Any], param_bytes: int) -> dict[str, Any]:
    """``communication_per_step()`` against "fsdp moves 3x the parameter bytes, zero2 2x".

    The registry counts each collective's input: a gather's shard, a
    reduce-scatter's full gradient; full size multiplies the gathers by the
    world size. Per graph, the full-size bytes show where a deviation comes from.
    """
    registry = measured["registry"]
    full = sum(c["bytes"] * (WORLD_SIZE if kind == "all_gather" else 1) for kind, c in registry.items())
    return {
        "communication_per_step": registry,
        "full_size_bytes": full,
        "full_size_bytes_by_graph": measured["registry_by_graph"],
        "formula_bytes": FORMULA[mode] * param_bytes,
        "formula_multiple": FORMULA[mode],
    }


def _median(step_ms: list[float]) -> float:
    return statistics.median(step_ms)


def _print_formula_checks(modes: dict[str, Any], param_bytes: int) -> None:
    print(f"\nformula check, communication_per_step() on rank 0 (P = parameter bytes = {param_bytes} B):")
    for mode, entry in modes.items():
        if "formula_check" not in entry:
            continue
        check = entry["formula_check"]
        registry = ", ".join(f"{k} {c['count']}x {c['bytes']} B" for k, c in check["communication_per_step"].items())
        by_graph = "; ".join(
            f"{graph}: " + ", ".join(f"{kind} {nbytes / param_bytes:.4f}P" for kind, nbytes in kinds.items())
            for graph, kinds in check["full_size_bytes_by_graph"].items()
        )
        agrees = check["full_size_bytes"] == entry["full_size_bytes_per_step"]
        print(
            f"  {mode}: {registry} (a gather's shard, a reduce-scatter's full gradient)\n"
            f"    full size {check['full_size_bytes']} B = {check['full_size_bytes'] / param_bytes:.4f}P vs formula "
            f"{check['formula_multiple']}P = {check['formula_bytes']} B "
            f"({check['full_size_bytes'] / check['formula_bytes'] - 1:+.2%}); "
            f"{'equals' if agrees else 'DIFFERS FROM'} the gloo bytes measured by the profiler\n"
            f"    by graph: {by_graph}"
        )


def report(ranks: list[dict[str, dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """Print the markdown table and the formula check; return what the JSON file records."""
    param_bytes = parameter_bytes()
    ok = [m for m in MODES if all("error" not in r[m] for r in ranks)]
    median = {m: [_median(r[m]["step_ms"]) for r in ranks] for m in ok}
    if "fsdp2_compiled" in ok:  # measured beside its own fsdp2_eager: scale to the first pair's
        reference = _median(ranks[0]["fsdp2_compiled"]["reference_fsdp2_eager"]["step_ms"])
        bridge = median["fsdp2_eager"][0] / reference
    peak = {m: max(r[m]["peak_bytes"] for r in ranks) for m in ok}
    print(
        f"\nGPT {GPTConfig()} ({param_bytes / 1e6:.2f} MB of parameters), {WORLD_SIZE} gloo ranks x 1 thread, "
        f"batch {args.batch_size}/rank, AdamW, {args.steps} measured steps in {args.rounds} turns after "
        f"{args.warmup} warm-up, compiled with {args.compiler}\n"
    )
    print(
        "| mode | step ms r0 | step ms r1 | x dpar_fsdp | peak MiB/rank | x fsdp2_eager "
        "| colls/step | MB/step | final loss r0 | final loss r1 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    modes: dict[str, Any] = {}
    for mode in MODES:
        if mode not in ok:
            error = next(r[mode]["error"] for r in ranks if "error" in r[mode])
            print(f"| {mode} | failed: {error[:160]} | | | | | | | | |")
            modes[mode] = {"error": error}
            continue
        comm = ranks[0][mode]["collectives"]
        full_bytes = sum(c["bytes"] for c in comm.values())
        ms_ratio = median[mode][0] / median["dpar_fsdp"][0] * (bridge if mode == "fsdp2_compiled" else 1.0)
        mem_ratio = peak[mode] / peak["fsdp2_eager"]
        losses = [r[mode]["final_loss"] for r in ranks]
        print(
            f"| {mode} | {median[mode][0]:.1f} | {median[mode][1]:.1f} | {ms_ratio:.2f} | "
            f"{peak[mode] / 2**20:.2f} | {mem_ratio:.3f} | {sum(c['count'] for c in comm.values())} | "
            f"{full_bytes / 1e6:.2f} | {losses[0]:.5f} | {losses[1]:.5f} |"
        )
        modes[mode] = {
            "median_step_ms_per_rank": median[mode],
            "iqr_step_ms_rank0": _iqr(ranks[0][mode]["step_ms"]),
            "ratio_to_dpar_fsdp": ms_ratio,
            "peak_bytes_max_over_ranks": peak[mode],
            "peak_ratio_to_fsdp2_eager": mem_ratio,
            "at_step_start_bytes_per_rank": [r[mode]["at_step_start_bytes"] for r in ranks],
            "collectives_per_step": comm,
            "full_size_bytes_per_step": full_bytes,
            "final_loss_per_rank": losses,
            "first_step_ms_rank0": ranks[0][mode]["first_step_ms"],
            "warmup_s_rank0": ranks[0][mode]["warmup_s"],
            "step_ms_per_rank": [r[mode]["step_ms"] for r in ranks],
        }
        if mode == "fsdp2_compiled":
            modes[mode]["separate_processes"] = {
                "fsdp2_eager_median_step_ms_rank0": reference,
                "fsdp2_eager_peak_bytes_max_over_ranks": max(
                    r[mode]["reference_fsdp2_eager"]["peak_bytes"] for r in ranks
                ),
                "why": "compiling the FSDP2 root marks GPT.forward skipped for the process (see run_all)",
            }
        if "registry" in ranks[0][mode]:
            modes[mode]["formula_check"] = formula_check(mode, ranks[0][mode], param_bytes)
    if "fsdp2_compiled" in ok:
        print(
            f"\nfsdp2_compiled ran in processes of its own beside a fresh fsdp2_eager ({reference:.1f} ms there): "
            "its x dpar_fsdp is scaled by fsdp2_eager's step time in the two pairs"
        )
    _print_formula_checks(modes, param_bytes)
    reference_losses = modes["fsdp2_eager"]["final_loss_per_rank"]
    spread = max(abs(modes[m]["final_loss_per_rank"][i] - reference_losses[i]) for m in ok for i in range(WORLD_SIZE))
    print(f"\nfinal losses: largest difference from fsdp2_eager {spread:.2e}")
    return {
        "benchmark": "sharded_step_time",
        "compiler": args.compiler,
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "threads_per_rank": 1,
        "model": dataclasses.asdict(GPTConfig()),
        "parameter_bytes": param_bytes,
        "batch_size_per_rank": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "memory_method": "torch.profiler profile_memory: running sum of allocator events, last warm-up step",
        "bytes_convention": "full size: all-gather output, reduce-scatter input (gloo runs it as all_reduce)",
        "torch": torch.__version__,
        "dpar_revision": revision(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "modes": modes,
    }


def _iqr(values: list[float]) -> float:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q3 - q1


def parse_args() -> argparse.Namespace:
    parser = step_time_parser(__doc__.split("\n\n")[0], "compiled FSDP2", "sharded_step_time")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first; compiles, the last is profiled")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    check_schedule(args, 3, "the first step compiles, one is timed, the last is profiled")
    start = time.perf_counter()
    record = report(run_all(args), args)
    record["wall_s"] = time.perf_counter() - start
    out = write_record(record, "sharded_step_time", args)
    print(f"wrote {out} after {record['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
