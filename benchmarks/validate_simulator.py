"""Does the report match reality? A real 2-rank gloo training step under torch.profiler, side by side
with ``dpar.explain`` for the same model at N = 2.

    python benchmarks/validate_simulator.py                         # examples/gpt.py, 1 MiB buckets
    python benchmarks/validate_simulator.py --target tests/x.py:fn --bucket-cap-mb 0.25

Measured per rank 0: every ``_c10d_functional`` collective the profiled step
issued (kind, bytes), the time gloo spent on them (its ``gloo:*`` events on the
worker threads), and the time the main thread sat blocked in ``wait_tensor``
(exposed communication). Overlap is 1 - exposed / comm, measured and simulated
alike. The simulation runs with a device spec calibrated in the same run: the
α and β of a 2-rank gloo all-reduce fitted from two sizes, the FLOP/s of a
matmul and the bandwidth of a large copy on this machine. The ranks run under a
timeout and are killed past it.
"""

from __future__ import annotations

import argparse
import os
import queue as queue_module
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import calibrate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"all_reduce": "all_reduce", "broadcast": "broadcast",
         "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8}


def _collective(name: str) -> str | None:
    prefix = "_c10d_functional::"
    return KINDS.get(name[len(prefix):]) if name.startswith(prefix) else None


def measure(events: Any) -> dict[str, Any]:
    issued, comm, exposed = [], 0.0, 0.0
    for e in events:
        kind = _collective(e.name)
        if kind is not None:
            numel = 1
            for s in e.input_shapes[0]:
                numel *= s
            dtype = (getattr(e, "input_types", None) or ["float"])[0]
            issued.append((kind, numel * DTYPE_BYTES.get(dtype, 4)))
        elif e.name.startswith("gloo:"):
            comm += e.time_range.elapsed_us() / 1e6
        elif e.name == "_c10d_functional::wait_tensor":
            exposed += e.time_range.elapsed_us() / 1e6
    return {"collectives": issued, "comm_s": comm, "exposed_s": exposed}


def rank_main(rank: int, port: int, target: str, bucket_cap_mb: float, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    try:
        import dpar  # noqa: F401
        from dpar.cli import load_target
        from torch.profiler import ProfilerActivity, profile

        dist.init_process_group("gloo", rank=rank, world_size=2)
        model, inputs = load_target(target)()
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager", "bucket_cap_mb": bucket_cap_mb})

        def step() -> None:
            out = compiled(*inputs)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()

        step()  # compile, and the first synchronisation of replicas
        step()
        calibration = calibrate()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            start = time.perf_counter()
            step()
            step_s = time.perf_counter() - start
        results.put((rank, "ok", {**measure(prof.events()), "step_s": step_s, "calibration": calibration}))
    except BaseException as exc:  # the parent reports it
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(target: str, bucket_cap_mb: float, timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=rank_main, args=(r, port, target, bucket_cap_mb, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(got) < 2:
            rank, status, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if status != "ok":
                raise SystemExit(f"rank {rank} failed: {payload}")
            got[rank] = payload
    except queue_module.Empty:
        raise SystemExit(f"ranks did not finish within {timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return got[0]


def simulate(target: str, bucket_cap_mb: float, calibration: dict[str, float]):
    from dpar.cli import load_target
    from dpar.compiler.costs import DeviceSpec
    from dpar.explaining import explain

    spec = DeviceSpec("this machine (calibrated)", calibration["flops"], calibration["flops"],
                      calibration["memory_bandwidth"], calibration["alpha"], calibration["link_bandwidth"])
    model, inputs = load_target(target)()
    return explain(model, inputs, world_size=2, device=spec, options={"bucket_cap_mb": bucket_cap_mb})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(ROOT / "examples" / "gpt.py"))
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()

    measured = run_ranks(args.target, args.bucket_cap_mb, args.timeout)
    report = simulate(args.target, args.bucket_cap_mb, measured["calibration"])
    cal = measured["calibration"]
    print(f"calibration: alpha={cal['alpha'] * 1e6:.1f} us, link={cal['link_bandwidth'] / 1e9:.2f} GB/s, "
          f"matmul={cal['flops'] / 1e9:.1f} GFLOP/s, copy={cal['memory_bandwidth'] / 1e9:.1f} GB/s")
    simulated = [(c.kind, c.bytes) for c in report.collectives]
    rows = max(len(simulated), len(measured["collectives"]))
    print(f"\n{'#':>3}  {'measured kind':<14}{'bytes':>12}   {'report kind':<14}{'bytes':>12}  match")
    for i in range(rows):
        m = measured["collectives"][i] if i < len(measured["collectives"]) else ("-", 0)
        s = simulated[i] if i < len(simulated) else ("-", 0)
        print(f"{i:>3}  {m[0]:<14}{m[1]:>12,}   {s[0]:<14}{s[1]:>12,}  {'yes' if m == s else 'NO'}")
    t = report.timeline
    comm = measured["comm_s"]
    overlap = 1 - measured["exposed_s"] / comm if comm > 0 else 1.0
    print(f"\n{'':<24}{'measured':>12}{'simulated':>12}")
    print(f"{'collectives':<24}{len(measured['collectives']):>12}{len(simulated):>12}")
    print(f"{'bytes':<24}{sum(b for _, b in measured['collectives']):>12,}{sum(b for _, b in simulated):>12,}")
    print(f"{'step time (ms)':<24}{measured['step_s'] * 1e3:>12.2f}{t.step_time * 1e3:>12.2f}")
    print(f"{'communication (ms)':<24}{comm * 1e3:>12.2f}{t.comm_time * 1e3:>12.2f}")
    print(f"{'exposed comm (ms)':<24}{measured['exposed_s'] * 1e3:>12.2f}{t.exposed_comm * 1e3:>12.2f}")
    print(f"{'overlap':<24}{overlap:>12.1%}{t.overlap:>12.1%}")
    sys.exit(0 if simulated == measured["collectives"] else 1)


if __name__ == "__main__":
    main()
