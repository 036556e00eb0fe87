"""A thread that walks the main thread's frames while torch.compile compiles crashes the process: no dpar.

Each run is a fresh process that trains a small model under ``torch.compile(backend="aot_eager")`` with graph
breaks, resetting Dynamo every 50 iterations so that it compiles again and again, for ``--seconds``. With
``walk`` a second thread reads the main thread's stack without pause as a watchdog would:
``sys._current_frames()``, then ``f_back`` to the outermost frame, reading each frame's code, line and
globals. ``still`` is the same process without that thread.

    python benchmarks/frame_walk_crash.py --runs 5 --seconds 90

[Note: what the frame walk does to a compiling process]
torch 2.13.0+cpu, Python 3.11.7, 2 shared cores, 2026-11-28: ``walk`` died of SIGSEGV in 4 of 5 runs of 90-120 s
on a quiet machine and in 1 of 4 runs of 60 s beside a test suite (the walking thread then got
the GIL less: 12 thousand to 1.9 million walks a run); ``still`` in none of 3 (one run of 120 s quiet, two of
60 s beside the suite). The core of a crash: the walking thread, inside ``f_back`` (``PyFrame_GetBack`` ->
``_PyFrame_IsIncomplete`` on a frame that was no longer there), the main thread inside Dynamo's compile.
Without recompiles (one compile, then 5,000 steps of the compiled model) 7.8 million walks crashed nothing. dpar's daemon thread did such walks (a few a second, more
while ranks waited for each other at a check); it no longer does: [Note: no thread reads another thread's
frames] in runtime/liveness.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time


def _child(walk: bool, seconds: float) -> None:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x).relu()
            torch._dynamo.graph_break()
            return self.b(y)

    model = torch.nn.Sequential(*[Block() for _ in range(4)])
    compiled = torch.compile(model, backend="aot_eager")
    walks = [0]
    done = threading.Event()

    def walker() -> None:
        main = threading.main_thread().ident
        while not done.is_set():
            frame = sys._current_frames().get(main)
            while frame is not None:
                _ = (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)
                frame = frame.f_back
            walks[0] += 1

    sys.setswitchinterval(1e-5)  # hand the GIL over often: the walks meet the compile at more points
    if walk:
        threading.Thread(target=walker, daemon=True).start()
    start, steps = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        compiled(torch.randn(8, 16, requires_grad=True)).sum().backward()
        steps += 1
        if steps % 50 == 0:
            torch._dynamo.reset()
    done.set()
    print(f"{steps} steps, {walks[0]} walks", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--modes", nargs="+", choices=("walk", "still"), default=["walk", "still"])
    parser.add_argument("--child", choices=("walk", "still"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child == "walk", args.seconds)
        return
    for mode in args.modes:
        crashed = 0
        for run in range(1, args.runs + 1):
            t0 = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-X", "faulthandler", __file__, "--child", mode, "--seconds", str(args.seconds)],
                capture_output=True, text=True, timeout=args.seconds + 300, env=dict(os.environ),
            )
            if done.returncode < 0:
                crashed += 1
                outcome = f"died of {signal.Signals(-done.returncode).name} after {time.monotonic() - t0:.0f} s"
            else:
                outcome = f"exit {done.returncode}: {done.stdout.strip() or done.stderr.strip()[-200:]}"
            print(f"{mode} run {run}: {outcome}", flush=True)
        print(f"{mode}: {crashed} of {args.runs} runs crashed", flush=True)


if __name__ == "__main__":
    main()
