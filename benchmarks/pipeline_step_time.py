"""Step time and bubble of ``dpar.pipeline`` against ``torch.distributed.pipelining``, on 2 gloo ranks.

    python benchmarks/pipeline_step_time.py                       # both GPTs, m = 2, 4, 8 (about 15 min)
    python benchmarks/pipeline_step_time.py --sizes small --micro-batches 4 --steps 4 --rounds 2
    python benchmarks/pipeline_step_time.py --world-size 4 --out /tmp/pp4.json   # 2 cores: oversubscribed

For each GPT size and micro-batch count ``m``, every rank builds these modes from the same weights
and trains them on the same batches with AdamW, taking turns (``--rounds``) so that load from other
users of the machine hits all of them alike:

- ``dpar_<schedule>``: ``dpar.pipeline`` over the world, each rank passing its own slice, its stage
  graphs run as Python; ``dpar_inductor_<schedule>`` the same with ``compiler="inductor"`` (every stage
  graph lowered by Inductor, the optimizer's step compiled) where ``--compilers`` names it;
- ``torch_<schedule>``: ``torch.distributed.pipelining`` (``PipelineStage`` and the matching
  schedule class) on the same model cut at the blocks dpar chose, stage ``s`` on rank ``s % p``, fed
  the global batch; the tied embedding / LM head gradient is summed over the two ranks holding it
  (dpar does the same inside its step), and that all-reduce is timed;
- ``torch_compiled_<schedule>`` (with ``--compilers ... inductor``): the same with each stage module
  under ``torch.compile`` and the optimizer's step too; torch refuses its zero-bubble schedules with
  compiled stages, which is recorded as that mode's error;
- ``floor``: forward and backward of the global batch on one rank, no communication (every rank
  runs it at once, one core each); floor / p is a perfect pipeline's step;
- ``ddp``: torch DDP on the same model, each rank its slice.

floor and ddp do not depend on m: they run beside the first m's modes only.

dpar's ``zb_h1`` is torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank (ZB1P, which
with v = 1 is ZB-H1), ``interleaved_1f1b`` runs 2 stages per rank on both, and ``zbv`` is torch's
``ScheduleZBVZeroBubble`` with the same V placement (stages ``r`` and ``2p - 1 - r`` on rank ``r``).

Bubble: ``measured_bubble()`` (dpar's own, from its action timeline) beside
``bubble_formula`` ((p-1)/(m+p-1); (p-1)/(vm+p-1) interleaved; ZB-H1's in simulate.py) and beside
``simulate()`` of the same schedule with each (op, stage)'s median measured duration: F, B, I, W
differ on a real model, so the simulation is what the measurement should match. For both libraries
the same "idle share of the step call" is also given: 1 - compute time / wall time of the
pipeline call (dpar's ``step()``; torch's ``schedule.step()`` plus the tied-weight all-reduce),
compute timed around the stage graphs (dpar's timeline) or ``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk`` and the loss (torch).

Losses: per step, dpar's loss is compared with torch pipelining's on the same schedule, and every
pipeline mode's with ``floor``'s (one process on the same global batch) where floor ran.
Writes benchmarks/results/pipeline_step_time.json (rank 0's step times, every rank's bubbles).
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import dpar
from dpar.compiler.pipeline_parallel.schedules import build_schedule, bubble_formula, stage_placement
from dpar.compiler.pipeline_parallel.simulate import simulate

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from gpt import GPT, GPTConfig, get_batch, load_corpus  # noqa: E402
from harness import revision, write_record  # noqa: E402

SIZES = {
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256),  # 3.3M parameters
    "large": GPTConfig(block_size=64, n_layer=8, n_head=8, n_embd=384),  # 14.3M parameters
}
# dpar schedule -> torch.distributed.pipelining class, stages per rank
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "zb_h1": ("ScheduleInterleavedZeroBubble", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
}

Batch = tuple[torch.Tensor, torch.Tensor]


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Timer:
    """Wall intervals of the compute calls wrapped into it, outermost calls only."""

    def __init__(self) -> None:
        self.busy = 0.0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.busy += time.perf_counter() - start

        return timed


@dataclasses.dataclass
class Trainer:
    """One mode: ``forward_backward(slice, global batch)`` leaves gradients and returns the loss."""

    forward_backward: Callable[[Batch, Batch], torch.Tensor | None]
    optimizer: torch.optim.Optimizer
    step_ms: list[float] = dataclasses.field(default_factory=list)
    losses: list[float | None] = dataclasses.field(default_factory=list)
    bubbles: list[float] = dataclasses.field(default_factory=list)  # dpar's measured_bubble()
    call_idle: list[float] = dataclasses.field(default_factory=list)  # 1 - compute / pipeline call
    durations: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # "F0" -> seconds, dpar
    probe: Callable[[float], None] | None = None  # records the bubble figures after a measured step

    def train(self, batches: Sequence[tuple[Batch, Batch]], measured: bool) -> None:
        for mine, whole in batches:
            start = time.perf_counter()
            loss = self.forward_backward(mine, whole)
            call_s = time.perf_counter() - start
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            elapsed = (time.perf_counter() - start) * 1e3
            if measured:
                self.step_ms.append(elapsed)
                self.losses.append(None if loss is None else loss.item())
                if self.probe is not None:
                    self.probe(call_s)


def gpt(config: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


class StageModule(nn.Module):
    """Blocks ``[first, end)`` of a GPT; the embeddings before them on stage 0, norm and head after on the last."""

    def __init__(self, model: GPT, first: int, end: int) -> None:
        super().__init__()
        self.is_first, self.is_last = first == 0, end == len(model.blocks)
        self.tok_emb = model.tok_emb if self.is_first else None
        self.pos_emb = model.pos_emb if self.is_first else None
        self.blocks = nn.ModuleList(model.blocks[first:end])
        self.ln_f = model.ln_f if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.is_last else x


def mode_names(schedule: str, compiler: str) -> tuple[str, str]:
    """(dpar's mode, torch's mode) of ``schedule`` with stage graphs as Python (aot_eager) or compiled (inductor)."""
    compiled = compiler == "inductor"
    return f"dpar_{'inductor_' if compiled else ''}{schedule}", f"torch_{'compiled_' if compiled else ''}{schedule}"


def build_dpar(config: GPTConfig, schedule: str, m: int, args: argparse.Namespace, example: Batch,
               compiler: str = "aot_eager") -> tuple[Trainer, list[int]]:
    """dpar's step; returns it and the first block of each stage dpar chose (for torch to copy)."""
    p = dist.get_world_size()
    model = gpt(config, args.seed)
    v = SCHEDULES[schedule][1]
    step = dpar.pipeline(model, token_loss, example_inputs=example, stages=p * v, micro_batches=m, schedule=schedule,
                         compiler=compiler)
    starts = [int(stage.blocks[0].rsplit(".", 1)[1]) for stage in step.split.stages]
    trainer = Trainer(lambda mine, whole: step(*mine), torch.optim.AdamW(model.parameters(), lr=args.lr))

    def probe(call_s: float) -> None:
        timeline = step.executor.timeline
        trainer.bubbles.append(step.measured_bubble())
        busy = 0.0
        for t in timeline:
            if t.action.op.is_compute:
                busy += t.end - t.start
                trainer.durations.setdefault(f"{t.action.op.value}{t.action.stage}", []).append(t.end - t.start)
        trainer.call_idle.append(1 - busy / call_s)

    trainer.probe = probe
    return trainer, starts


def build_torch(config: GPTConfig, schedule: str, m: int, args: argparse.Namespace, starts: list[int],
                compiled: bool = False) -> Trainer:
    """The same model cut at ``starts``, this rank's stages under torch's schedule class; ``compiled``: each
    stage module under ``torch.compile`` (Inductor) and the optimizer's step compiled."""
    rank, p = dist.get_rank(), dist.get_world_size()
    model = gpt(config, args.seed)
    ends = [*starts[1:], config.n_layer]
    stage_ids = [s for s, r in enumerate(stage_placement(schedule, p, len(starts))) if r == rank]  # zbv: a V
    modules = [StageModule(model, starts[s], ends[s]) for s in stage_ids]

    timer = Timer()
    stages = []
    for s, module in zip(stage_ids, modules):
        # torch.compile's wrapper, not module.compile(): the zero-bubble schedules refuse the wrapper when built, on
        # every rank alike; an in-place compiled module passes that check and fails one rank mid-step (a hang).
        stage = pipelining.PipelineStage(torch.compile(module) if compiled else module, s, len(starts),
                                         torch.device("cpu"))
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, timer.wrap(getattr(stage, name)))
        stages.append(stage)
    cls = getattr(pipelining, SCHEDULES[schedule][0])
    runner = cls(stages if len(stages) > 1 or cls.__name__.startswith("ScheduleInterleaved") else stages[0],
                 n_microbatches=m, loss_fn=token_loss)
    runner._compute_loss = timer.wrap(runner._compute_loss)
    # The tied embedding and head, as Megatron and torchtitan run them across stages: the last stage holds its own
    # copy, and the two gradients are summed into both before the step (equal from then on). One parameter read by
    # two stages of one rank (zbv's V puts stages 0 and 2p - 1 on rank 0) got a wrong gradient from torch's ZBV.
    last_here = any(mod.is_last for mod in modules)
    tied = [model.tok_emb.weight] if any(mod.is_first for mod in modules) else []
    for mod in modules:
        if mod.is_last:
            mod.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            mod.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
            tied.append(mod.lm_head.weight)
    params = list(dict.fromkeys(q for mod in modules for q in mod.parameters()))

    def forward_backward(mine: Batch, whole: Batch) -> torch.Tensor | None:
        x, y = whole
        timer.busy = 0.0
        losses: list[torch.Tensor] = []
        inputs = (x,) if any(mod.is_first for mod in modules) else ()
        runner.step(*inputs, target=y if last_here else None, losses=losses, return_outputs=False)
        grad = torch.zeros_like(model.tok_emb.weight)  # a rank without the embedding or the head adds zeros
        for weight in tied:
            if weight.grad is not None:
                grad += weight.grad
        dist.all_reduce(grad)
        for weight in tied:
            weight.grad = grad
        return torch.stack(losses).mean() if losses else None

    optimizer = torch.optim.AdamW(params, lr=args.lr)
    if compiled:
        optimizer.step = torch.compile(optimizer.step)
    trainer = Trainer(forward_backward, optimizer)
    trainer.probe = lambda call_s: trainer.call_idle.append(1 - timer.busy / call_s)
    return trainer


def build_floor(config: GPTConfig, args: argparse.Namespace) -> Trainer:
    model = gpt(config, args.seed)

    def forward_backward(mine: Batch, whole: Batch) -> torch.Tensor:
        loss = token_loss(model(whole[0]), whole[1])
        loss.backward()
        return loss.detach()

    return Trainer(forward_backward, torch.optim.AdamW(model.parameters(), lr=args.lr))


def build_ddp(config: GPTConfig, args: argparse.Namespace) -> Trainer:
    model = gpt(config, args.seed)
    ddp = DistributedDataParallel(model)

    def forward_backward(mine: Batch, whole: Batch) -> None:
        token_loss(ddp(mine[0]), mine[1]).backward()
        return None  # the slice's loss: not comparable with the global batch's

    return Trainer(forward_backward, torch.optim.AdamW(model.parameters(), lr=args.lr))


def batches_for(config: GPTConfig, args: argparse.Namespace, count: int) -> list[tuple[Batch, Batch]]:
    """(this rank's slice, the global batch) per step: every rank draws the global batch."""
    rank, p = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(args.seed)
    data = load_corpus()
    out = []
    for _ in range(count):
        x, y = get_batch(data, args.batch_size * p, config.block_size, generator)
        out.append(((x.chunk(p)[rank].contiguous(), y.chunk(p)[rank].contiguous()), (x, y)))
    return out


def run_group(config: GPTConfig, m: int, baselines: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Every mode for one model and micro-batch count, warmed up, then measured in turns.

    ``baselines``: floor and ddp too (they do not depend on m: measured in the first group only)."""
    # Each group compiles afresh: torch's compiled modes share code objects (StageModule.forward, AdamW.step) across
    # groups, and past Dynamo's recompile limit they would silently run eagerly.
    torch.compiler.reset()
    batches = batches_for(config, args, args.warmup + args.steps)
    trainers: dict[str, Trainer] = {"floor": build_floor(config, args), "ddp": build_ddp(config, args)} if baselines else {}
    for trainer in trainers.values():
        trainer.train(batches[:1], measured=False)  # as every mode below, at its build
    errors: dict[str, str] = {}
    build_s: dict[str, float] = {}
    for schedule in args.schedules:
        if schedule == "interleaved_1f1b" and (m % dist.get_world_size() or 2 * dist.get_world_size() > config.n_layer):
            continue
        for compiler in args.compilers:
            ours, theirs = mode_names(schedule, compiler)
            start = time.perf_counter()
            trainers[ours], starts = build_dpar(config, schedule, m, args, batches[0][0], compiler)
            trainers[ours].train(batches[:1], measured=False)  # lowers the stage graphs: build time
            build_s[ours] = time.perf_counter() - start
            try:
                trainers[theirs] = build_torch(config, schedule, m, args, starts, compiled=compiler == "inductor")
                trainers[theirs].train(batches[:1], measured=False)  # shape inference: fail here
            except Exception as exc:  # noqa: BLE001  (recorded and reported: the other modes go on)
                trainers.pop(theirs, None)
                errors[theirs] = f"{type(exc).__name__}: {exc}".splitlines()[0][:600]
            dist.barrier()
    for name, trainer in trainers.items():
        trainer.train(batches[1 : args.warmup], measured=False)  # each mode ran batch 0 when it was built
    per_turn = args.steps // args.rounds
    for turn in range(args.rounds):
        first = args.warmup + turn * per_turn
        for trainer in trainers.values():
            dist.barrier()  # modes start their turn together; steps inside a turn run without one
            trainer.train(batches[first : first + per_turn], measured=True)
    result = {
        name: {"step_ms": t.step_ms, "losses": t.losses, "bubbles": t.bubbles, "call_idle": t.call_idle,
               "durations": {k: statistics.median(v) for k, v in t.durations.items()}}
        for name, t in trainers.items()
    }
    result["errors"] = errors
    result["build_s"] = build_s
    del trainers
    gc.collect()
    return result


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    return {size: {str(m): run_group(SIZES[size], m, m == args.micro_batches[0], args) for m in args.micro_batches}
            for size in args.sizes}


def _spread(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "q1": q[0], "q3": q[2]}


def simulated(schedule: str, p: int, m: int, durations: dict[str, float]) -> dict[str, Any]:
    """simulate() of the schedule with the measured median durations of each (op, stage)."""
    v = SCHEDULES[schedule][1]
    plan = build_schedule(schedule, num_ranks=p, micro_batches=m, virtual_stages=v)
    timeline = simulate(plan, lambda a: durations[f"{a.op.value}{a.stage}"])
    return {"bubble_per_rank": list(timeline.bubble), "span_ms": timeline.span * 1e3}


def summarise(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    p = len(ranks)
    groups: dict[str, Any] = {}
    for size in args.sizes:
        for m in args.micro_batches:
            per_rank = [r[size][str(m)] for r in ranks]
            first = per_rank[0]
            modes = [k for k in first if k not in ("errors", "build_s")]
            floor = first.get("floor", {}).get("losses")
            entry: dict[str, Any] = {"size": size, "micro_batches": m, "errors": first["errors"],
                                     "dpar_build_s_rank0": first["build_s"], "modes": {}}
            for mode in modes:
                row: dict[str, Any] = {
                    "step_ms_rank0": _spread(first[mode]["step_ms"]),
                    "median_step_ms_per_rank": [statistics.median(r[mode]["step_ms"]) for r in per_rank],
                    "step_ms_per_rank": [r[mode]["step_ms"] for r in per_rank],
                }
                losses = [next(x for x in step if x is not None) if any(x is not None for x in step) else None
                          for step in zip(*(r[mode]["losses"] for r in per_rank))]
                if mode != "ddp":
                    row["losses"] = losses
                if floor and mode.startswith(("dpar", "torch")):
                    row["max_abs_loss_diff_vs_floor"] = max(abs(a - b) for a, b in zip(losses, floor))
                if mode.startswith(("dpar", "torch")):
                    row["call_idle_per_rank"] = [statistics.median(r[mode]["call_idle"]) for r in per_rank]
                if mode.startswith("dpar"):
                    schedule = mode.removeprefix("dpar_").removeprefix("inductor_")
                    durations = {k: v for r in per_rank for k, v in r[mode]["durations"].items()}
                    row["measured_bubble_per_rank"] = [statistics.median(r[mode]["bubbles"]) for r in per_rank]
                    row["formula_bubble"] = bubble_formula(schedule, p, m, SCHEDULES[schedule][1])
                    row["median_action_ms"] = {k: v * 1e3 for k, v in durations.items()}
                    row["simulated"] = simulated(schedule, p, m, durations)
                entry["modes"][mode] = row
            for schedule in args.schedules:
                for ours_name, theirs_name in (mode_names(schedule, c) for c in ("aot_eager", "inductor")):
                    ours, theirs = entry["modes"].get(ours_name), entry["modes"].get(theirs_name)
                    if ours and theirs:
                        ours["ratio_to_torch"] = ours["step_ms_rank0"]["median"] / theirs["step_ms_rank0"]["median"]
                        ours["max_abs_loss_diff_vs_torch"] = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
            torch_modes = {k: v["step_ms_rank0"]["median"] for k, v in entry["modes"].items() if k.startswith("torch")}
            if torch_modes:
                best = min(torch_modes, key=torch_modes.get)
                entry["best_torch"] = {"mode": best, "median_ms": torch_modes[best]}
                for name, mode in entry["modes"].items():
                    if name.startswith("dpar"):
                        mode["ratio_to_best_torch"] = mode["step_ms_rank0"]["median"] / torch_modes[best]
            groups[f"{size}_m{m}"] = entry
    return groups


def print_table(groups: dict[str, Any], p: int) -> None:
    print(f"\n| model | m | schedule | dpar ms (min-max) | torch ms (min-max) | dpar / torch | bubble r0 / r1 measured "
          f"| simulated | formula | idle share of call dpar / torch (r0, r1) |")
    print("|---|---:|---|---:|---:|---:|---|---|---:|---|")
    for entry in groups.values():
        modes = entry["modes"]
        pairs = [(*mode_names(s, c), s + (", compiled" if c == "inductor" else ""))
                 for c in ("aot_eager", "inductor") for s in SCHEDULES]
        for ours_name, theirs_name, schedule in pairs:
            ours = modes.get(ours_name)
            if ours is None:
                continue
            theirs = modes.get(theirs_name)
            ms = lambda r: f"{r['step_ms_rank0']['median']:.0f} ({r['step_ms_rank0']['min']:.0f}-{r['step_ms_rank0']['max']:.0f})"
            pct = lambda xs: " / ".join(f"{x:.0%}" for x in xs)
            idle = pct(ours["call_idle_per_rank"]) + " vs " + (pct(theirs["call_idle_per_rank"]) if theirs else "-")
            if theirs:
                compared = f"{ms(theirs)} | {ours['ratio_to_torch']:.2f}"
            else:
                compared = f"failed: {entry['errors'].get(theirs_name, 'not run')[:120]} | -"
            print(f"| {entry['size']} | {entry['micro_batches']} | {schedule} | {ms(ours)} | {compared} | "
                  f"{pct(ours['measured_bubble_per_rank'])} | {pct(ours['simulated']['bubble_per_rank'])} | "
                  f"{ours['formula_bubble']:.0%} | {idle} |")
        for mode in ("floor", "ddp"):
            if mode not in modes:
                continue
            r = modes[mode]["step_ms_rank0"]
            extra = f" (floor / {p} = {r['median'] / p:.0f})" if mode == "floor" else ""
            print(f"| {entry['size']} | {entry['micro_batches']} | {mode} | {r['median']:.0f} ({r['min']:.0f}-{r['max']:.0f}){extra} | | | | | | |")
        if "best_torch" in entry:
            best = entry["best_torch"]
            ratios = ", ".join(f"{k.removeprefix('dpar_')} {v['ratio_to_best_torch']:.2f}" for k, v in modes.items()
                               if k.startswith("dpar"))
            print(f"| {entry['size']} | {entry['micro_batches']} | dpar / best torch ({best['mode']}, "
                  f"{best['median_ms']:.0f} ms): {ratios} | | | | | | | | |")
    for against, what in (("torch", "torch pipelining, same schedule"), ("floor", "floor, one process")):
        key = f"max_abs_loss_diff_vs_{against}"
        worst = max(((mode[key], f"{group} {name}") for group, entry in groups.items()
                     for name, mode in entry["modes"].items() if key in mode), default=None)
        if worst:
            print(f"losses: largest difference of a step's loss from {what}: {worst[0]:.2e} ({worst[1]})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    parser.add_argument("--compilers", nargs="+", choices=["aot_eager", "inductor"], default=["aot_eager"],
                        help="dpar's stage graphs as Python (aot_eager) and/or lowered by Inductor; inductor also "
                             "runs torch pipelining with compiled stage modules")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (the machine has 2 cores)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per mode")
    parser.add_argument("--rounds", type=int, default=6, help="turns the modes take, steps / rounds steps each")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (torch's first infers shapes)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="fail (and kill the ranks) after this")
    parser.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/pipeline_step_time.json)")
    args = parser.parse_args()
    if args.warmup < 2 or args.rounds < 1 or args.steps % args.rounds:
        raise SystemExit("--warmup must be at least 2 and --steps a multiple of --rounds")
    args.compiler = "+".join(args.compilers)  # write_record's file name
    return args


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    ranks = run_ranks(run_rank, args.world_size, args, timeout_s=args.timeout_s)
    groups = summarise(ranks, args)
    print(f"\n{args.world_size} gloo ranks x 1 thread ({os.cpu_count()} cores), batch {args.batch_size}/rank, "
          f"AdamW, {args.steps} measured steps in {args.rounds} turns after {args.warmup} warm-up; rank 0's step ms")
    print_table(groups, args.world_size)
    record = {
        "benchmark": "pipeline_step_time",
        "world_size": args.world_size,
        "oversubscribed": args.world_size > (os.cpu_count() or 1),
        "backend": "gloo",
        "threads_per_rank": 1,
        "models": {size: dataclasses.asdict(SIZES[size]) for size in args.sizes},
        "batch_size_per_rank": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "dpar_revision": revision(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch_classes": {k: v[0] for k, v in SCHEDULES.items()},
        "compilers": args.compilers,
        "groups": groups,
        "wall_s": time.perf_counter() - start,
    }
    out = write_record(record, "pipeline_step_time", args)
    print(f"wrote {out} after {record['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
