"""How long a checkpoint stalls training: dpar.checkpoint.save against async_save, and the cost of
options={"check_finite": True}.

    python benchmarks/checkpoint_save.py

2 gloo ranks, ddp, AdamW, the example GPT (0.83M parameters) and a bigger one (n_layer=8, n_embd=512:
25.6M parameters, 307 MB of model and optimizer state per checkpoint). A loop of 8 steps saves at
step 2: "blocked" is how long the save call holds the loop (rank 0, median of 3 saves; of 1 for the bigger model), "published"
how long until the checkpoint is complete on disk, and the loop's total time against a loop without
a save says what the background writing costs the steps meanwhile (both ranks share two cores here,
so the writer thread competes with training; on a GPU host it would not). The 25.6M model runs one
loop per mode; check_finite is timed on the small one (its cost alone: see the README). Writes
benchmarks/results/checkpoint_save.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "examples"), str(REPO / "tests")]
from distributed import run_ranks  # noqa: E402  (the tests' launcher: gloo ranks under a timeout)
from gpt import GPT, GPTConfig  # noqa: E402

MODELS = {"gpt 0.83M": GPTConfig(), "gpt 25.6M": GPTConfig(n_layer=8, n_embd=512)}
STEPS, SAVE_AT = 8, 2
REPEATS = {"gpt 0.83M": 3, "gpt 25.6M": 1}


def loop(rank: int, world_size: int, name: str, mode: str, directory: str, check_finite: bool = False) -> dict:
    import dpar

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = MODELS[name]
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager", "check_finite": check_finite})
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        tokens = torch.randint(0, config.vocab_size, (8, config.block_size + 1), generator=g)
        opt.zero_grad()
        runner(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()).backward()
        opt.step()

    for _ in range(3):  # compile and warm up
        step()
    blocked, published, loops, steps = [], [], [], []
    for _ in range(REPEATS[name]):
        future = None
        start = time.perf_counter()
        for i in range(STEPS):
            if i == SAVE_AT and mode != "none":
                saved_at = time.perf_counter()
                if mode == "save":
                    dpar.checkpoint.save(runner, opt, f"{directory}/ckpt")
                else:
                    future = dpar.checkpoint.async_save(runner, opt, f"{directory}/ckpt")
                blocked.append(time.perf_counter() - saved_at)
            t = time.perf_counter()
            step()
            steps.append(time.perf_counter() - t)
        loops.append(time.perf_counter() - start)
        if future is not None:
            future.result()
            published.append(time.perf_counter() - saved_at)  # an upper bound: the loop ran on meanwhile
        elif mode == "save":
            published.append(blocked[-1])
    return {
        "blocked_s": statistics.median(blocked) if blocked else 0.0,
        "published_s": statistics.median(published) if published else 0.0,
        "loop_s": statistics.median(loops),
        "step_s": statistics.median(steps),
    }


def main() -> None:
    results = {}
    for name, config in MODELS.items():
        params = sum(p.numel() for p in GPT(config).parameters())
        for mode in ("none", "save", "async_save"):
            with tempfile.TemporaryDirectory() as directory:
                rank0 = run_ranks(loop, 2, name, mode, directory, timeout_s=900)[0]
            results[f"{name} {mode}"] = {"parameters": params, **rank0}
            print(name, mode, {k: round(v, 4) for k, v in rank0.items()}, flush=True)
        for check in (False, True) if name == "gpt 0.83M" else ():
            with tempfile.TemporaryDirectory() as directory:
                rank0 = run_ranks(loop, 2, name, "none", directory, check, timeout_s=900)[0]
            results[f"{name} check_finite={check}"] = rank0
            print(name, f"check_finite={check}", {k: round(v, 4) for k, v in rank0.items()}, flush=True)
    out = REPO / "benchmarks" / "results" / "checkpoint_save.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
