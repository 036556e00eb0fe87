"""Measured against modelled: per model and strategy on 2 gloo ranks, the step's peak activation memory
and compute time as this CPU runs them, beside what ``dpar.explain`` models for the same (model,
strategy, N = 2, device), with the device calibrated in the same run.

    python benchmarks/measured_vs_modelled.py            # all models x ddp, zero2, fsdp (~10 min)
    python benchmarks/measured_vs_modelled.py --quick    # llama-4m under ddp and fsdp
    python benchmarks/measured_vs_modelled.py --models llama-25m --strategies fsdp

Goal (issue 25): peak activation within 15 %, compute time within 25 %; each row says PASS or MISS.

Measured, per rank, after two warm-up steps (the first compiles):

* peak activation: the forward + backward of one step under ``torch.profiler`` with
  ``profile_memory=True``, started just before it; the running sum of c10's allocator events
  (``harness.live_bytes``) peaks at the bytes the step holds above what was live when it began (the
  state: parameters or shards, optimizer state; gradients are freed by ``zero_grad(set_to_none)``).
  That peak is everything the graphs keep at once: saved activations, gathered parameters, gradients
  produced so far and not yet reduced or stored, collective buffers. The allocator sees the compiled
  graphs' tensors and gloo's buffers alike; ``torch.distributed._tools.mem_tracker.MemTracker``
  counts through a Python dispatch mode and module hooks, which a compiled graph (one opaque call
  from the module's view, run by AOTAutograd's runtime) does not pass through op by op, and on CPU it
  reads the same allocator figures anyway, so the profiler is the one reading used.
* compute time: the forward + backward's wall time (median of plain timed steps) minus the time the
  main thread sat in ``wait_tensor`` (read from a profiled step): what the step spends not blocked
  on communication. The optimizer step is outside it, as it is outside the model's graphs. A 1-rank
  run would have no collectives at all, but a different graph (no gathers, no buckets) and none of
  gloo's threads competing for the two cores, which the 2-rank step pays and the cpu preset's
  ``overlap`` already prices separately; subtracting the waits keeps the very step measured.

Modelled: ``dpar.explain(model, one rank's batch, world_size=2, strategy=..., device=spec)`` with
``spec`` the cpu preset's shape and this run's calibration (``harness.calibrate``: matmul FLOP/s,
copy bandwidth, gloo α and β), peak activation = ``Memory.activations + Memory.gathered`` (the step's
live graph bytes at their peak, [Note: a step's live bytes] in compiler/memory.py) and compute =
``Timeline.compute_time`` (the roofline of every node of the forward and backward graphs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from harness import RESULTS, calibrate, live_bytes, revision  # noqa: E402

WORLD_SIZE = 2
STRATEGIES = ("ddp", "zero2", "fsdp")
MEMORY_GOAL, COMPUTE_GOAL = 0.15, 0.25
WARMUP, TIMED = 2, 3


def _llama(hidden: int, layers: int, intermediate: int, vocab: int, heads: int) -> torch.nn.Module:
    from models import LlamaLM

    return LlamaLM(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=heads)


def _tokens(vocab: int, rows: int, seq: int, shift: bool) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    def batch(rank: int, step: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(1000 * rank + step))
        return ids, (torch.roll(ids, -1, 1) if shift else ids)
    return batch


def _gpt() -> torch.nn.Module:
    from gpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=128, n_layer=4, n_embd=256))


def _convbn() -> torch.nn.Module:
    import third_party

    return third_party.build("resnet")


def _image_batch(rows: int) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    def batch(rank: int, step: int) -> tuple[torch.Tensor, ...]:
        import third_party

        return third_party.rank_slice(third_party.global_batch(step, WORLD_SIZE * rows), rank, WORLD_SIZE)
    return batch


# name -> (build, one rank's batch for (rank, step)); HF Llama shifts its labels itself.
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int, int], tuple[torch.Tensor, ...]]]] = {
    "llama-4m": (lambda: _llama(256, 4, 512, 2048, 4), _tokens(2048, 4, 128, shift=False)),
    "llama-25m": (lambda: _llama(512, 6, 1376, 4096, 8), _tokens(4096, 4, 128, shift=False)),
    "llama-100m": (lambda: _llama(768, 12, 2048, 8192, 12), _tokens(8192, 2, 128, shift=False)),
    "gpt-3m": (_gpt, _tokens(256, 8, 128, shift=True)),
    "convbn": (_convbn, _image_batch(16)),
}


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters (or shards) and optimizer state this rank holds between steps."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    seen, total = set(), 0
    tensors = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in tensors:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measure(rank: int, world_size: int, model_name: str, strategies: tuple[str, ...]) -> dict[str, Any]:
    """On one rank: per strategy, peak activation bytes and compute seconds of a steady-state step."""
    import dpar
    from torch.profiler import ProfilerActivity, profile, record_function

    batch = MODELS[model_name][1]
    calibration = calibrate()
    out: dict[str, Any] = {"calibration": calibration, "strategies": {}}
    for strategy in strategies:
        torch._dynamo.reset()
        model = dpar.parallelize(_build(model_name), strategy=strategy)
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def forward_backward(step: int) -> None:
            loss = compiled(*batch(rank, step))
            loss.backward()

        def finish() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for step in range(WARMUP):
            forward_backward(step)
            finish()
        state = _state_bytes(model, optimizer)
        times = []
        for step in range(WARMUP, WARMUP + TIMED):
            dist.barrier()
            start = time.perf_counter()
            forward_backward(step)
            times.append(time.perf_counter() - start)
            finish()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("forward+backward"):
                forward_backward(WARMUP + TIMED)
        _, peak = live_bytes(prof, "forward+backward")
        finish()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            forward_backward(WARMUP + TIMED + 1)
        waited = sum(e.time_range.elapsed_us() for e in prof.events()
                     if e.name == "_c10d_functional::wait_tensor") / 1e6
        finish()
        step_s = statistics.median(times)
        out["strategies"][strategy] = {
            "state_bytes": state, "peak_activation_bytes": peak, "forward_backward_s": step_s,
            "waited_s": waited, "compute_s": max(step_s - waited, 0.0),
        }
        del model, compiled, optimizer
    return out


def device_from(calibration: dict[str, float]):
    """The cpu preset with this run's calibrated figures in place of its typical ones."""
    import dataclasses

    from dpar.compiler.costs import PRESETS

    return dataclasses.replace(
        PRESETS["cpu"], name="cpu (calibrated)", flops_fp32=calibration["flops"], flops_16bit=calibration["flops"],
        memory_bandwidth=calibration["memory_bandwidth"], alpha=calibration["alpha"],
        link_bandwidth=calibration["link_bandwidth"],
    )


def modelled(model_name: str, strategy: str, spec: Any) -> dict[str, Any]:
    import dpar

    report = dpar.explain(_build(model_name), MODELS[model_name][1](0, WARMUP), world_size=WORLD_SIZE,
                          strategy=strategy, device=spec)
    m, t = report.memory, report.timeline
    return {
        "state_bytes": m.parameters + m.optimizer, "gradient_bytes": m.gradients,
        "activation_bytes": m.activations, "gathered_bytes": m.gathered,
        "peak_activation_bytes": m.activations + m.gathered, "compute_s": t.compute_time,
    }


def _verdict(ratio: float, goal: float) -> str:
    return "PASS" if abs(ratio - 1) <= goal else "MISS"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="llama-4m under ddp and fsdp only")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per model: kill the ranks after this")
    parser.add_argument("--out", type=Path, default=RESULTS / "measured_vs_modelled.json")
    args = parser.parse_args()
    models = ["llama-4m"] if args.quick else args.models.split(",")
    strategies = ("ddp", "fsdp") if args.quick else tuple(args.strategies.split(","))

    rows, calibrations = [], []
    header = (f"{'model':11} {'strategy':8} {'state MiB':>9} {'act meas':>9} {'act model':>9} {'ratio':>6}     "
              f"{'cmp meas ms':>11} {'cmp model ms':>12} {'ratio':>6}")
    print(header, flush=True)
    for name in models:
        began = time.perf_counter()
        ranks = run_ranks(measure, WORLD_SIZE, name, strategies, timeout_s=args.timeout_s)
        calibration = {k: statistics.median(r["calibration"][k] for r in ranks) for k in ranks[0]["calibration"]}
        calibrations.append({"model": name, **calibration})
        spec = device_from(calibration)
        for strategy in strategies:
            per_rank = [r["strategies"][strategy] for r in ranks]
            measured = {
                "per_rank": per_rank,
                "peak_activation_bytes": max(r["peak_activation_bytes"] for r in per_rank),
                "state_bytes": max(r["state_bytes"] for r in per_rank),
                "compute_s": statistics.mean(r["compute_s"] for r in per_rank),
            }
            model = modelled(name, strategy, spec)
            act = model["peak_activation_bytes"] / measured["peak_activation_bytes"]
            cmp = model["compute_s"] / measured["compute_s"]
            rows.append({"model": name, "strategy": strategy, "measured": measured, "modelled": model,
                         "activation_ratio": act, "compute_ratio": cmp,
                         "activation": _verdict(act, MEMORY_GOAL), "compute": _verdict(cmp, COMPUTE_GOAL)})
            print(f"{name:11} {strategy:8} {measured['state_bytes'] / 2**20:9.1f} "
                  f"{measured['peak_activation_bytes'] / 2**20:9.1f} {model['peak_activation_bytes'] / 2**20:9.1f} "
                  f"{act:6.2f} {rows[-1]['activation']} {measured['compute_s'] * 1e3:11.1f} "
                  f"{model['compute_s'] * 1e3:12.1f} {cmp:6.2f} {rows[-1]['compute']}", flush=True)
        print(f"  ({name}: {time.perf_counter() - began:.0f} s; calibration: matmul {calibration['flops'] / 1e9:.1f} "
              f"GFLOP/s, copy {calibration['memory_bandwidth'] / 1e9:.2f} GB/s, alpha {calibration['alpha'] * 1e6:.0f} us, "
              f"link {calibration['link_bandwidth'] / 1e9:.2f} GB/s)", flush=True)
    record = {
        "revision": revision(), "torch": torch.__version__, "world_size": WORLD_SIZE,
        "goal": {"peak_activation": MEMORY_GOAL, "compute": COMPUTE_GOAL},
        "method": __doc__, "calibrations": calibrations, "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
