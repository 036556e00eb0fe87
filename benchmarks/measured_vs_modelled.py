"""Measured against modelled: per model and strategy on 2 gloo ranks, the step's peak activation memory
and compute time as this CPU runs them, beside what ``dpar.explain`` models for the same (model,
strategy, N = 2, device), with the device calibrated in the same run.

    python benchmarks/measured_vs_modelled.py            # all models x ddp, zero2, fsdp (~10 min)
    python benchmarks/measured_vs_modelled.py --quick    # llama-4m under ddp and fsdp
    python benchmarks/measured_vs_modelled.py --models llama-25m --strategies fsdp
    python benchmarks/measured_vs_modelled.py --device cuda --world-size 8 --models llama-500m   # one GPU

Goal (issue 25): peak activation within 15 %, compute time within 25 %; each row says PASS or MISS.

Measured, per rank, after two warm-up steps (the first compiles), on the third step:

* peak activation: the forward + backward of one step under ``torch.profiler`` with
  ``profile_memory=True``, started just before it; the running sum of c10's allocator events
  (``harness.live_bytes``) peaks at the bytes the step holds above what was live when it began (the
  state: parameters or shards, optimizer state; gradients are freed by ``zero_grad(set_to_none)``).
  That peak is everything the graphs keep at once: saved activations, gathered parameters, gradients
  produced so far and not yet reduced or stored, collective buffers. The allocator sees the compiled
  graphs' tensors and gloo's buffers alike. ``torch.distributed._tools.mem_tracker.MemTracker`` sees
  compiled graphs too (a 16-layer MLP under aot_eager: 68.25 MiB above the parameters, the profiler's
  figure to the byte), but it works by a dispatch mode and global module hooks around the step (torch
  warns that the hooks fire again on the compiled module, and Dynamo guards on them), so it changes
  the step it measures; the allocator's events only observe it, so they are the reading used.
* compute time: the CPU time of the rank's main thread (``time.thread_time``) over the forward +
  backward, the median of 5 steps. With one intra-op thread per rank every kernel runs on that
  thread; a wait on a collective sleeps (gloo's work waits on a condition variable) and gloo's own
  threads are not counted, so this is the step's compute without its communication. Wall time less
  the profiler's ``wait_tensor`` time was the first choice, but on this machine (2 cores shared by
  several jobs, load average 5-11 while measuring) a step's wall time swung 2x from step to step and
  ``wait_tensor`` does not see time lost to the neighbours; thread CPU time varied by under 10 %.
  A 1-rank run would have no collectives, but a different graph (no gathers, no buckets). The
  optimizer step is outside it, as it is outside the model's graphs. The calibration's matmul and
  copy are timed the same way (``harness.calibrate(clock=time.thread_time)``), right before the
  timed steps of each strategy; wall times are recorded beside (``forward_backward_wall_s``).
  Of it, the thread time inside dpar's compiled graphs is recorded too (``in_graphs_s``): the rest is
  torch's host work around the graphs (Dynamo's guards, AOTAutograd's wrappers, DTensor's wrapping of a
  sharded parameter and its gradient, autograd's accumulation into ``.grad``), which no graph prices and
  which a sharded strategy's DTensor parameters make larger (ConvBN, 62 parameters: ~2 ms around ddp's
  graphs, ~5 ms around zero2's and fsdp's). The verdict is on the whole step; beside it the part around
  the graphs as measured and as modelled, and "profiled / in the graphs" (the priced step less the modelled
  work around the graphs, over the time inside them), to tell the two apart.

Modelled: ``dpar.explain(model, one rank's batch, world_size=2, strategy=..., device="cpu")`` (the
preset the ranks planned their buckets and prefetch with, so the graphs are the ones that ran), its
compute priced on ``spec``, the cpu preset's shape with this run's calibration (``harness.calibrate``: matmul FLOP/s,
copy bandwidth, gloo α and β, a collective's host seconds), peak activation = ``Memory.step_peak`` (the step's live graph bytes at
their peak, gradients produced by then included: [Note: gradients live to the optimizer] in
compiler/memory.py; on the cpu preset with gloo's staging buffers for all-gathers and reduce-scatters, [Note:
gloo stages its gathers and reductions]), and compute =
``Timeline.compute_time`` (the roofline of every node of the forward and backward graphs, and the host
work the cpu preset prices beside them: each collective's calling-thread seconds, and the work around the
graphs per parameter and buffer, [Note: host work the graphs' kernels do not show]). Beside it,
"profiled": the same graphs priced with their kernels timed by the ranks, each on its own graphs, both at
once, right after each timed step (``dpar.compiler.kernel_profile.time_kernels``, what ``dpar inspect
--profile-kernels`` prices with; [Note: profile-guided kernel costs] in compiler/costs.py), averaged over
the two ranks; its ratio is the median over the rounds of (that round's priced compute / that round's
step), because this shared host's speed drifts by up to 2x over minutes (the same strategy's step
measured 1.04 s and 1.37 s in two runs of one afternoon), which a ratio of figures taken minutes apart
would carry.

On a GPU (``--device cuda``) one process stands in for rank 0 of ``--world-size`` ranks on torch's fake
process group: its collectives return at once, so what is timed is the rank's own compute (CUDA events
over the forward + backward, the median of 5 steps) and what is measured its memory
(``torch.cuda.max_memory_allocated`` over the forward + backward, above what was allocated as it began:
the state, as on the CPU). The gathers and reductions still allocate their outputs, so gathered
parameters and gradient buckets are in the peak as on real ranks. fp32 matmuls run as TF32
(``set_float32_matmul_precision("high")``), as the GPU presets price them. Modelled: ``dpar.explain`` on
the meta device for the preset of the GPU's name (``spec_of_device``: the one the rank planned its buckets
and prefetch with), its compute priced on that preset and on the preset with this GPU's calibrated
matmul FLOP/s and copy bandwidth (``calibrate_gpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from harness import RESULTS, calibrate, live_bytes, report_pairs, revision  # noqa: E402

from dpar.compiler.kernel_profile import time_kernels  # noqa: E402

WORLD_SIZE = 2
STRATEGIES = ("ddp", "zero2", "fsdp")
MEMORY_GOAL, COMPUTE_GOAL = 0.15, 0.25
WARMUP, TIMED = 2, 5


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
    # GPU-sized (--device cuda): 0.5B parameters, 4 x 1024 tokens a rank
    "llama-500m": (lambda: _llama(2048, 8, 5632, 32000, 16), _tokens(32000, 4, 1024, shift=False)),
    "gpt-3m": (_gpt, _tokens(256, 8, 128, shift=True)),
    "convbn": (_convbn, _image_batch(16)),
}


GPU_SIZED = ("llama-500m",)  # 6 GiB of state a rank: on 2 CPU ranks it does not fit beside its optimizer


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


def _warmed_up(model_name: str, strategy: str, policy: str, batch: Callable[[int], tuple[torch.Tensor, ...]],
               device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[int], None], Callable[[], None],
                                             list[torch.fx.GraphModule]]:
    """The model built on ``device``, parallelized and compiled, its AdamW, a step as forward + backward
    (of a batch made before it, out of what is timed) and the optimizer's part, after ``WARMUP`` steps (the first compiles), and the
    forward and backward graphs dpar compiled."""
    import dpar
    from dpar.compiler.registry import recording

    torch._dynamo.reset()
    with torch.device(device):
        model = dpar.parallelize(_build(model_name), strategy=strategy, activation_checkpointing=policy)
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def forward_backward(inputs: tuple[torch.Tensor, ...]) -> None:
        compiled(*inputs).backward()

    def finish() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with recording() as compiled_graphs:
        for step in range(WARMUP):
            forward_backward(batch(step))
            finish()
    return model, optimizer, forward_backward, finish, [g.graph for g in compiled_graphs if g.label != "joint graph"]


@contextlib.contextmanager
def _in_graphs() -> Iterator[list[float]]:
    """Thread CPU seconds spent inside dpar's compiled graphs while open (a running total in the list): the
    step's time less this is torch's host work around the graphs (Dynamo's guards, AOTAutograd's wrappers,
    DTensor's wrapping of inputs and gradients, autograd's accumulation into ``.grad``), which no graph prices."""
    from dpar.runtime.liveness import Watched

    total, call = [0.0], Watched.__call__

    def timed(self: Watched, args: list[Any]) -> Any:
        began = time.thread_time()
        try:
            return call(self, args)
        finally:
            total[0] += time.thread_time() - began

    Watched.__call__ = timed  # type: ignore[method-assign]
    try:
        yield total
    finally:
        Watched.__call__ = call  # type: ignore[method-assign]


def measure(rank: int, world_size: int, model_name: str, cases: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """On one rank: per (strategy, activation policy), peak activation bytes and compute seconds of a steady-state step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    batch = MODELS[model_name][1]
    out: dict[str, Any] = {"strategies": {}}
    for strategy, policy in cases:
        model, optimizer, forward_backward, finish, graphs = _warmed_up(
            model_name, strategy, policy, lambda step: batch(rank, step))
        state = _state_bytes(model, optimizer)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("forward+backward"):
                forward_backward(batch(rank, WARMUP))
        _, peak = live_bytes(prof, "forward+backward")
        finish()
        calibration = calibrate(clock=time.thread_time)
        dist.barrier()
        steps, kernels = [], []
        for step in range(WARMUP + 1, WARMUP + 1 + TIMED):
            inputs = batch(rank, step)
            with _in_graphs() as in_graphs:
                wall, cpu = time.perf_counter(), time.thread_time()
                forward_backward(inputs)
                steps.append((time.thread_time() - cpu, time.perf_counter() - wall, in_graphs[0]))
            finish()
            # This rank's graphs as the step just ran them, in the same round: on a shared host the machine's
            # speed drifts by 2x over minutes, so each round's step is compared with its own kernel times.
            timed = time_kernels(graphs, torch.device("cpu"), repeats=3, warmups=1)
            kernels.append({"kernel_seconds": timed.seconds, "kernels_untimed": timed.untimed})
        compute, wall = statistics.median(s[0] for s in steps), statistics.median(s[1] for s in steps)
        out["strategies"][_key(strategy, policy)] = {
            "state_bytes": state, "peak_activation_bytes": peak, "calibration": calibration,
            "compute_s": compute, "forward_backward_wall_s": wall, "in_graphs_s": statistics.median(s[2] for s in steps),
            "steps": steps, "kernel_rounds": kernels,
        }
        del model, optimizer, forward_backward, finish, graphs
    return out


def calibrate_gpu(matmul: int = 8192) -> dict[str, float]:
    """This GPU's fp32 matmul FLOP/s (as TF32, as the model's matmuls run) and the bandwidth of a 1 GiB
    copy (bytes read + written per second), timed by CUDA events, the median of 10 after 3 warm-ups."""
    def seconds(fn: Callable[[], Any]) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    a, b = torch.randn(matmul, matmul, device="cuda"), torch.randn(matmul, matmul, device="cuda")
    big = torch.empty(1 << 28, device="cuda")
    return {"flops": 2 * matmul**3 / seconds(lambda: a @ b), "memory_bandwidth": 2 * big.nbytes / seconds(big.clone)}


def measure_gpu(model_name: str, cases: tuple[tuple[str, str], ...], world_size: int,
                profile: bool = False) -> dict[str, Any]:
    """Rank 0 of ``world_size`` ranks on this GPU, over torch's fake process group (see the module's note):
    per (strategy, activation policy), peak bytes above the state and compute seconds of a steady step."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_float32_matmul_precision("high")
    batch = MODELS[model_name][1]
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "calibration": calibrate_gpu(), "strategies": {}}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        for strategy, policy in cases:
            on_gpu = lambda step: tuple(t.cuda() for t in batch(0, step))  # noqa: E731
            model, optimizer, forward_backward, finish, _ = _warmed_up(model_name, strategy, policy, on_gpu, device="cuda")
            torch.cuda.synchronize()
            state = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            forward_backward(on_gpu(WARMUP))
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - state
            finish()
            steps = []
            for step in range(WARMUP + 1, WARMUP + 1 + TIMED):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                inputs = on_gpu(step)
                torch.cuda.synchronize()
                wall = time.perf_counter()
                start.record()
                forward_backward(inputs)
                end.record()
                torch.cuda.synchronize()
                steps.append((start.elapsed_time(end) / 1e3, time.perf_counter() - wall))
                finish()
            if profile:  # where the measured time goes, kernel by kernel, beside the modelled roofline
                from torch.profiler import ProfilerActivity
                with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
                    forward_backward(on_gpu(WARMUP + 1 + TIMED))
                    torch.cuda.synchronize()
                finish()
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
            out["strategies"][_key(strategy, policy)] = {
                "state_bytes": state, "peak_activation_bytes": peak,
                "compute_s": statistics.median(s[0] for s in steps), "steps": steps,
            }
            print(f"  measured {model_name} {_key(strategy, policy)}: peak {peak / 2**20:.1f} MiB, "
                  f"{out['strategies'][_key(strategy, policy)]['compute_s'] * 1e3:.2f} ms", flush=True)
            del model, optimizer, forward_backward, finish
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    return out


def gpu_device_from(preset: str, calibration: dict[str, float]):
    """The GPU preset with this GPU's calibrated matmul FLOP/s and copy bandwidth in place of the datasheet's."""
    import dataclasses

    from dpar.compiler.costs import PRESETS

    return dataclasses.replace(PRESETS[preset], name=f"{preset} (calibrated)", flops_tf32=calibration["flops"],
                               memory_bandwidth=calibration["memory_bandwidth"])


def main_gpu(args: argparse.Namespace, models: list[str], cases: tuple[tuple[str, str], ...]) -> None:
    """``--device cuda``: per model, measure on this GPU (written at once to ``<out>.measured.json``), then
    model on meta for its preset, calibrated and not. The modelling needs no GPU: ``--measure-only`` on the
    GPU and ``--measured <that file>`` anywhere else split the two."""
    measured_path = args.out.with_suffix(".measured.json")
    if args.measured is not None:
        measurements = json.loads(args.measured.read_text())
    else:
        from dpar.compiler.costs import spec_of_device

        preset = spec_of_device(torch.device("cuda")).name
        measurements = {"revision": revision(), "torch": torch.__version__, "world_size": args.world_size,
                        "preset": preset, "models": {}}
        for name in models:
            measurements["models"][name] = measure_gpu(name, cases, args.world_size, args.profile)
            measured_path.parent.mkdir(parents=True, exist_ok=True)
            measured_path.write_text(json.dumps(measurements, indent=2) + "\n")  # a cut-off run keeps what it measured
        print(f"wrote {measured_path}", flush=True)
        if args.measure_only:
            return
    preset, world_size = measurements["preset"], measurements["world_size"]
    rows = []
    print(f"{'model':11} {'strategy':14} {'state MiB':>9} {'act meas':>9} {'act model':>9} {'ratio':>6}      "
          f"{'cmp meas ms':>11} {'preset ms':>9} {'ratio':>6}      {'calib. ms':>9} {'ratio':>6}", flush=True)
    for name, measured in measurements["models"].items():
        calibrated = gpu_device_from(preset, measured["calibration"])
        print(f"  {measured['gpu']}, rank 0 of {world_size}: matmul {measured['calibration']['flops'] / 1e12:.0f} "
              f"TFLOP/s (TF32), copy {measured['calibration']['memory_bandwidth'] / 1e12:.2f} TB/s; preset {preset}",
              flush=True)
        for label, meas in measured["strategies"].items():
            strategy, _, policy = label.partition("/")
            model = modelled(name, strategy, policy or "keep", calibrated, world_size=world_size, preset=preset,
                             on_meta=True)
            act = model["peak_activation_bytes"] / meas["peak_activation_bytes"]
            on_preset = model["compute_preset_s"] / meas["compute_s"]
            on_calibrated = model["compute_s"] / meas["compute_s"]
            rows.append({"model": name, "strategy": label, "gpu": measured["gpu"], "preset": preset,
                         "calibration": measured["calibration"], "measured": meas, "modelled": model,
                         "activation_ratio": act, "compute_ratio_preset": on_preset,
                         "compute_ratio_calibrated": on_calibrated, "activation": _verdict(act, MEMORY_GOAL),
                         "compute": _verdict(on_calibrated, COMPUTE_GOAL)})
            print(f"{name:11} {label:14} {meas['state_bytes'] / 2**20:9.1f} {meas['peak_activation_bytes'] / 2**20:9.1f} "
                  f"{model['peak_activation_bytes'] / 2**20:9.1f} {act:6.2f} {rows[-1]['activation']} "
                  f"{meas['compute_s'] * 1e3:11.2f} {model['compute_preset_s'] * 1e3:9.2f} {on_preset:6.2f}      "
                  f"{model['compute_s'] * 1e3:9.2f} {on_calibrated:6.2f} {rows[-1]['compute']}", flush=True)
    record = {"revision": revision(), "measured_revision": measurements["revision"], "torch_measured": measurements["torch"],
              "world_size": world_size, "device": "cuda", "goal": {"peak_activation": MEMORY_GOAL, "compute": COMPUTE_GOAL},
              "method": __doc__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


def device_from(calibration: dict[str, float]):
    """The cpu preset with this run's calibrated figures in place of its typical ones."""
    import dataclasses

    from dpar.compiler.costs import PRESETS

    return dataclasses.replace(
        PRESETS["cpu"], name="cpu (calibrated)", flops_fp32=calibration["flops"], flops_16bit=calibration["flops"],
        memory_bandwidth=calibration["memory_bandwidth"], alpha=calibration["alpha"],
        link_bandwidth=calibration["link_bandwidth"], collective_host_seconds=calibration["collective_host_seconds"],
    )


def _key(strategy: str, policy: str) -> str:
    return strategy if policy == "keep" else f"{strategy}/{policy}"


def modelled(model_name: str, strategy: str, policy: str, spec: Any, world_size: int = WORLD_SIZE,
             preset: str = "cpu", on_meta: bool = False, kernels: list[Any] | None = None) -> dict[str, Any]:
    """``dpar.explain``'s figures for the plan the ranks ran, compute priced on the calibrated ``spec``.

    The report is made for the cpu preset, the device the ranks' own bucket and prefetch plans were
    made for (``spec_of_device``), so that its graphs are the ones that ran; their compute is then
    priced on ``spec`` (``build_timeline``)."""
    import dataclasses

    import dpar
    from dpar.compiler.collectives import runs_an_op
    from dpar.compiler.costs import kernel_key
    from dpar.inspect.timeline import build_timeline

    inputs = MODELS[model_name][1](0, WARMUP)
    if on_meta:  # a GPU-sized model: traced on meta, nothing allocated
        with torch.device("meta"):
            model = _build(model_name)
        inputs = tuple(t.to("meta") for t in inputs)
    else:
        model = _build(model_name)
    report = dpar.explain(model, inputs, world_size=world_size, strategy=strategy, device=preset,
                          activation_checkpointing=policy)
    m = report.memory
    pairs = report_pairs(report)
    graphs = [("forward", f) for f, _ in pairs] + [("backward", b) for _, b in reversed(pairs) if b is not None]
    profiled = {}
    if kernels:  # the ranks' kernel times (a ``KernelTimes`` per round) price the report's graphs
        priced = [build_timeline(graphs, world_size, dataclasses.replace(spec, kernel_times=k),
                                 host_seconds=report.host_around_graphs).compute_time for k in kernels]
        ops = {kernel_key(n) for _, g in graphs for n in g.graph.nodes if runs_an_op(n)}
        profiled = {"compute_profiled_s": statistics.median(priced), "compute_profiled_rounds_s": priced,
                    "kernels": f"{kernels[0].describe()}; of the report's {len(ops)}, "
                               f"{len(ops - set(kernels[0].by_key))} by the roofline"}
    return {
        "state_bytes": m.parameters + m.optimizer, "gradient_bytes": m.gradients,
        "activation_bytes": m.activations, "gathered_bytes": m.gathered,
        "peak_activation_bytes": m.step_peak,
        "compute_s": build_timeline(graphs, world_size, spec, host_seconds=report.host_around_graphs).compute_time,
        "compute_preset_s": report.timeline.compute_time, "host_around_graphs_s": report.host_around_graphs, **profiled,
    }


def _kernel_times(per_rank: list[dict[str, Any]]) -> Any:
    """One round's kernel times from every rank, averaged per kernel: the ranks timed them at once."""
    from dpar.compiler.costs import KernelTimes

    tables = [dict(r["kernel_seconds"]) for r in per_rank]
    common = set.intersection(*(set(t) for t in tables))
    return KernelTimes("cpu", tuple((key, statistics.mean(t[key] for t in tables)) for key in sorted(common)),
                       max(r["kernels_untimed"] for r in per_rank) + len(set.union(*(set(t) for t in tables)) - common))


def _verdict(ratio: float, goal: float) -> str:
    return "PASS" if abs(ratio - 1) <= goal else "MISS"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="llama-4m under ddp and fsdp only")
    parser.add_argument("--models", default=None, help=f"of {', '.join(MODELS)}; default: every model but the GPU-sized "
                        f"{', '.join(GPU_SIZED)} on the CPU, those on a GPU")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--activation-checkpointing", default="keep",
                        help="policies measured per strategy, e.g. keep,selective,full (the peak should drop as modelled)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per model: kill the ranks after this")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: 2 gloo ranks; cuda: this GPU as rank 0 of --world-size on the fake process group")
    parser.add_argument("--world-size", type=int, default=8, help="--device cuda: the ranks the one GPU stands in for")
    parser.add_argument("--measure-only", action="store_true", help="--device cuda: measure, write, and stop")
    parser.add_argument("--profile", action="store_true", help="--device cuda: print each case's kernels by CUDA time")
    parser.add_argument("--measured", type=Path, help="--device cuda: model the measurements of this file (no GPU needed)")
    parser.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/measured_vs_modelled[_gpu].json)")
    args = parser.parse_args()
    args.out = args.out or RESULTS / ("measured_vs_modelled_gpu.json" if args.device == "cuda" else "measured_vs_modelled.json")
    on_cpu = [name for name in MODELS if name not in GPU_SIZED]
    models = ["llama-4m"] if args.quick else (args.models or ",".join(on_cpu if args.device == "cpu" else GPU_SIZED)).split(",")
    strategies = ("ddp", "fsdp") if args.quick else tuple(args.strategies.split(","))
    cases = tuple((s, p) for s in strategies for p in args.activation_checkpointing.split(","))
    if args.device == "cuda":
        return main_gpu(args, models, cases)

    rows, calibrations = [], []
    header = (f"{'model':11} {'strategy':8} {'state MiB':>9} {'act meas':>9} {'act model':>9} {'ratio':>6}      "
              f"{'cmp meas ms':>11} {'cmp model ms':>12} {'ratio':>6}      {'profiled ms':>11} {'ratio':>6}")
    print(header, flush=True)
    for name in models:
        began = time.perf_counter()
        ranks = run_ranks(measure, WORLD_SIZE, name, cases, timeout_s=args.timeout_s)
        for strategy, policy in cases:
            label = _key(strategy, policy)
            per_rank = [r["strategies"][label] for r in ranks]
            calibration = {k: statistics.median(r["calibration"][k] for r in per_rank) for k in per_rank[0]["calibration"]}
            calibrations.append({"model": name, "strategy": label, **calibration})
            spec = device_from(calibration)
            measured = {
                "per_rank": per_rank,
                "peak_activation_bytes": max(r["peak_activation_bytes"] for r in per_rank),
                "state_bytes": max(r["state_bytes"] for r in per_rank),
                "compute_s": statistics.mean(r["compute_s"] for r in per_rank),
            }
            timed_by_rank = [r.pop("kernel_rounds") for r in per_rank]
            rounds = [_kernel_times([timed[k] for timed in timed_by_rank]) for k in range(TIMED)]
            model = modelled(name, strategy, policy, spec, kernels=rounds)
            act = model["peak_activation_bytes"] / measured["peak_activation_bytes"]
            cmp = model["compute_s"] / measured["compute_s"]
            # Per round: the ranks' mean step against the graphs priced with that round's kernel times.
            round_ratios = [profiled / statistics.mean(r["steps"][k][0] for r in per_rank)
                            for k, profiled in enumerate(model["compute_profiled_rounds_s"])]
            cmp_profiled = statistics.median(round_ratios)
            measured["profiled_round_ratios"] = round_ratios
            measured["in_graphs_s"] = statistics.mean(r["in_graphs_s"] for r in per_rank)
            in_graphs_ratio = statistics.median(  # the graphs' own part of the priced step against the time in them
                (profiled - model["host_around_graphs_s"]) / statistics.mean(r["steps"][k][2] for r in per_rank)
                for k, profiled in enumerate(model["compute_profiled_rounds_s"]))
            rows.append({"model": name, "strategy": label, "measured": measured, "modelled": model,
                         "activation_ratio": act, "compute_ratio": cmp,
                         "compute_profiled_ratio": cmp_profiled, "compute_profiled_in_graphs_ratio": in_graphs_ratio,
                         "activation": _verdict(act, MEMORY_GOAL),
                         "compute": _verdict(cmp, COMPUTE_GOAL), "compute_profiled": _verdict(cmp_profiled, COMPUTE_GOAL)})
            print(f"{name:11} {label:8} {measured['state_bytes'] / 2**20:9.1f} "
                  f"{measured['peak_activation_bytes'] / 2**20:9.1f} {model['peak_activation_bytes'] / 2**20:9.1f} "
                  f"{act:6.2f} {rows[-1]['activation']} "
                  f"{measured['compute_s'] * 1e3:11.1f} "
                  f"{model['compute_s'] * 1e3:12.1f} {cmp:6.2f} {rows[-1]['compute']} "
                  f"{model['compute_profiled_s'] * 1e3:11.1f} {cmp_profiled:6.2f} {rows[-1]['compute_profiled']}", flush=True)
            print(f"{'':20} kernels: {model['kernels']}", flush=True)
            print(f"{'':20} step {measured['compute_s'] * 1e3:.1f} ms = in the graphs {measured['in_graphs_s'] * 1e3:.1f} ms "
                  f"+ torch's host work around them {(measured['compute_s'] - measured['in_graphs_s']) * 1e3:.1f} ms "
                  f"(modelled {model['host_around_graphs_s'] * 1e3:.1f}); profiled / in the graphs {in_graphs_ratio:.2f}",
                  flush=True)
            print(f"{'':20} calibrated: matmul {calibration['flops'] / 1e9:.1f} GFLOP/s, copy "
                  f"{calibration['memory_bandwidth'] / 1e9:.2f} GB/s, alpha {calibration['alpha'] * 1e6:.0f} us, link "
                  f"{calibration['link_bandwidth'] / 1e9:.2f} GB/s", flush=True)
        print(f"  ({name}: {time.perf_counter() - began:.0f} s)", flush=True)
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
