"""Bulk synchronous (ddp) against local SGD: loss against steps, bytes communicated and wall time.

    python benchmarks/local_sgd.py                 # 2 and 4 gloo ranks: ddp, H = 4, 16, 64, DiLoCo at 16
    python benchmarks/local_sgd.py --world-sizes 2 --steps 128

The example GPT, AdamW, every mode from the same weights on the same batches (rank r draws
from a generator seeded with seed + r). The training loss is each replica's on its own rows,
averaged over ranks (that average is not timed nor counted). Bytes are what each rank sends
and receives for the graphs' collectives, from the recorded graphs: a ring all-reduce of P
bytes moves 2 (N - 1) / N x P per rank. At the end every mode's replicas are averaged once
more (local SGD's last period is cut short) and the model is evaluated on held-out batches.
Writes benchmarks/results/local_sgd.json and local_sgd.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dpar
from dpar.compiler.registry import recording

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "examples"), str(REPO / "tests")]
from distributed import run_ranks  # noqa: E402  (the tests' launcher: gloo ranks under a timeout)
from gpt import GPT, GPTConfig, get_batch, load_corpus  # noqa: E402
from harness import RESULTS, revision, timed_steps  # noqa: E402  (beside this file)


def ring_bytes(payload: int, world_size: int) -> float:
    return 2 * (world_size - 1) / world_size * payload


def train_mode(mode: str, rank: int, world_size: int, args: argparse.Namespace, batches, held_out) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig())
    if mode != "ddp":  # local_sgd_H, or diloco_H: the same with DiLoCo's outer Nesterov step
        outer = dpar.OuterSGD(lr=0.7, momentum=0.9) if mode.startswith("diloco") else None
        dpar.parallelize(model, strategy="local_sgd", sync_every=int(mode.split("_")[-1]), outer_optimizer=outer)
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, seconds, elapsed = [], [], 0.0
    with recording() as graphs:
        for batch in batches:  # one step at a time: the loss's average over ranks is not timed
            (step_ms,), loss = timed_steps(compiled, optimizer, [batch])
            elapsed += step_ms / 1e3
            seconds.append(elapsed)
            mean = torch.tensor(loss)
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
    # Payload per event: ddp's backward all-reduces every step, local SGD's averaging forward every H steps.
    payload = {g.label: sum(c.bytes for c in g.collectives if c.kind == "all_reduce") for g in graphs}
    if mode == "ddp":
        per_step = [ring_bytes(payload["backward graph (sync)"], world_size)] * len(batches)
    else:
        every = int(mode.split("_")[-1])
        averaged = ring_bytes(payload.get("forward graph (average)", 0), world_size)
        per_step = [averaged if step and step % every == 0 else 0.0 for step in range(len(batches))]
    with torch.no_grad():  # local SGD's last period, cut short: average once more before evaluating
        for p in model.parameters():
            dist.all_reduce(p)
            p /= world_size
        evaluated = sum(model(x, y).item() for x, y in held_out) / len(held_out)
    cumulative = torch.tensor(per_step).cumsum(0).tolist()
    return {"loss": losses, "seconds": seconds, "bytes": cumulative, "held_out_loss": evaluated,
            "step_ms_median": 1e3 * float(torch.tensor(seconds).diff().median()) if len(seconds) > 1 else 0.0}


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    config, data = GPTConfig(), load_corpus()
    generator = torch.Generator().manual_seed(args.seed + rank)
    batches = [get_batch(data, args.batch_size, config.block_size, generator) for _ in range(args.steps)]
    held = torch.Generator().manual_seed(10_000)
    held_out = [get_batch(data, args.batch_size, config.block_size, held) for _ in range(8)]
    return {mode: train_mode(mode, rank, world_size, args, batches, held_out) for mode in args.modes}


def plot(record: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = record["worlds"]
    fig, axes = plt.subplots(len(worlds), 3, figsize=(15, 4.2 * len(worlds)), squeeze=False)
    for row, (world, modes) in zip(axes, worlds.items()):
        for mode, r in modes.items():
            smooth = torch.tensor(r["loss"]).unfold(0, 8, 1).mean(1).tolist()  # 8-step running mean
            row[0].plot(range(8, len(r["loss"]) + 1), smooth, label=mode)
            row[1].plot([b / 1e6 for b in r["bytes"][7:]], smooth, label=mode)
            row[2].plot(r["seconds"][7:], smooth, label=mode)
        for ax, xlabel in zip(row, ("step", "MB sent+received per rank", "seconds of training")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel("training loss (8-step mean)")
            ax.set_title(f"{world} ranks")
        row[1].set_xscale("symlog", linthresh=1)
        row[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", default=["ddp", "local_sgd_4", "local_sgd_16", "local_sgd_64", "diloco_16"])
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1500.0)
    args = parser.parse_args()
    record = {"revision": revision(), "torch": torch.__version__, "steps": args.steps, "batch_size": args.batch_size,
              # Losses and bytes agree across ranks; times are rank 0's.
              "worlds": {str(n): run_ranks(run_rank, n, args, timeout_s=args.timeout_s)[0] for n in args.world_sizes}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "local_sgd.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, RESULTS / "local_sgd.png")
    for world, modes in record["worlds"].items():
        ddp = modes.get("ddp")
        for mode, r in modes.items():
            saved = 1 - r["bytes"][-1] / ddp["bytes"][-1] if ddp else float("nan")
            print(f"{world} ranks {mode:>13}: final loss {sum(r['loss'][-16:]) / len(r['loss'][-16:]):.3f}, held-out {r['held_out_loss']:.3f}, "
                  f"{r['bytes'][-1] / 1e6:8.1f} MB ({saved:6.1%} saved), {r['seconds'][-1]:6.1f} s, "
                  f"median step {r['step_ms_median']:.1f} ms")


if __name__ == "__main__":
    main()
