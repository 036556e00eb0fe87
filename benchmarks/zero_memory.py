"""Per-rank bytes of parameters, gradients and AdamW state under ddp, zero1, zero2 and fsdp, measured.

    python benchmarks/zero_memory.py   # the example GPT at 2, 4 and 8 simulated ranks (fake process group)

One training step of the example GPT per strategy and world size; parameters and
optimizer state are read off the tensors each holds after the step (a shard's local
part), gradients after the backward and before the step. Writes
benchmarks/results/zero_memory.json and prints the table the README quotes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import dpar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
from gpt import GPT, GPTConfig, get_batch, load_corpus  # noqa: E402
from harness import RESULTS, revision  # noqa: E402  (beside this file)

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def measure(strategy: str, world_size: int) -> dict[str, int]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = dpar.parallelize(GPT(GPTConfig()), strategy=strategy)
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        opt = torch.optim.AdamW(model.parameters())
        x, y = get_batch(load_corpus(), 2, GPTConfig().block_size, torch.Generator().manual_seed(0))
        compiled(x, y).backward()
        grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        opt.step()
        return {
            "parameters": sum(local_bytes(p) for p in model.parameters()),
            "gradients": grads,
            "optimizer": sum(local_bytes(t) for s in opt.state.values() for k, t in s.items() if k != "step"),
        }
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def main() -> None:
    worlds = (2, 4, 8)
    table = {str(n): {s: measure(s, n) for s in STRATEGIES} for n in worlds}
    record = {"revision": revision(), "torch": torch.__version__, "model": "example GPT, AdamW fp32", "bytes": table}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "zero_memory.json").write_text(json.dumps(record, indent=1) + "\n")
    print("| ranks | strategy | parameters MB | gradients MB | AdamW state MB | total MB | ddp / this |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for n, by_strategy in table.items():
        ddp_total = sum(by_strategy["ddp"].values())
        for s, b in by_strategy.items():
            total = sum(b.values())
            print(f"| {n} | {s} | {b['parameters'] / 1e6:.2f} | {b['gradients'] / 1e6:.2f} | {b['optimizer'] / 1e6:.2f} "
                  f"| {total / 1e6:.2f} | {ddp_total / total:.2f}x |")


if __name__ == "__main__":
    main()
