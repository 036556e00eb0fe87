"""Peak tensor memory per rank of the example GPT under ddp, zero2 and fsdp, on 2 gloo ranks.

    python benchmarks/peak_memory.py     # writes benchmarks/results/peak_memory.json

Each rank builds the model, ``dpar.parallelize``s it (ddp: unchanged), compiles
it with ``backend="dpar"`` (aot_eager), builds AdamW and trains 2 steps. Step 1
compiles; the figure is step 2's peak, the steady state, with the parameters
(or shards), optimizer state and everything the step allocates.

How it is measured: ``torch.profiler`` with ``profile_memory=True``, started
before the model exists, records every allocation and free of c10's CPU
allocator as a ``[memory]`` event with its size. Their running sum is the
bytes of live tensor storage in this process, which is what the strategies
change; it sees the compiled graphs' intermediates and the collectives'
buffers alike, since all of them go through that allocator. Process RSS would
add the Python heap, Inductor/Dynamo state and allocator caching that the
strategies do not affect, and ``MemTracker``/dispatch-mode counting only sees
ops that pass through a Python dispatch mode, which compiled graphs need not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from harness import live_bytes  # noqa: E402
from gpt import GPT, GPTConfig, get_batch, load_corpus  # noqa: E402

WORLD_SIZE = 2  # the CPU machines have 2 cores: one rank per core
STRATEGIES = ("ddp", "zero2", "fsdp")
STEPS = 2
BATCH_SIZE = 8
RESULTS = HERE / "results" / "peak_memory.json"


def train(rank: int, world_size: int, strategy: str) -> dict[str, int | float]:
    import dpar

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        config = GPTConfig()
        model = dpar.parallelize(GPT(config), strategy=strategy)
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data, generator = load_corpus(), torch.Generator().manual_seed(rank)
        for step in range(STEPS):
            with record_function(f"step {step}"):
                x, y = get_batch(data, BATCH_SIZE, config.block_size, generator)
                loss = compiled(x, y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    at_start, peak = live_bytes(prof, f"step {STEPS - 1}")
    dist.all_reduce(loss := loss.detach())
    return {"peak_bytes": peak, "at_step_start_bytes": at_start, "mean_loss": loss.item() / world_size}


def main() -> None:
    results = {s: run_ranks(train, WORLD_SIZE, s, timeout_s=600) for s in STRATEGIES}
    ddp_peak = max(r["peak_bytes"] for r in results["ddp"])
    summary = {
        "world_size": WORLD_SIZE,
        "steps": STEPS,
        "batch_size_per_rank": BATCH_SIZE,
        "torch": torch.__version__,
        "method": "torch.profiler profile_memory: running sum of CPU allocator [memory] events",
        "strategies": {
            s: {
                "per_rank": ranks,
                "peak_bytes_max_over_ranks": max(r["peak_bytes"] for r in ranks),
                "peak_ratio_to_ddp": max(r["peak_bytes"] for r in ranks) / ddp_peak,
            }
            for s, ranks in results.items()
        },
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'strategy':8} {'peak/rank (MiB)':>16} {'at step start (MiB)':>20} {'peak vs ddp':>12}")
    for s, entry in summary["strategies"].items():
        start = max(r["at_step_start_bytes"] for r in entry["per_rank"])
        print(f"{s:8} {entry['peak_bytes_max_over_ranks'] / 2**20:16.2f} {start / 2**20:20.2f}"
              f" {entry['peak_ratio_to_ddp']:12.3f}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
