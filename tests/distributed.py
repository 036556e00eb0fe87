"""Running a function on N gloo ranks as real processes, under a timeout."""

from __future__ import annotations

import faulthandler
import io
import os
import queue as queue_module
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Rank processes fork from one server that imported torch, dpar and the Hugging Face models once (a fresh
# interpreter importing them costs 3-7 s a rank on these two cores, which every launch paid under "spawn").
RANK_CONTEXT = mp.get_context("forkserver")
RANK_CONTEXT.set_forkserver_preload(["rank_preload"])


def _entry(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any, crash_dir: str, env: dict
) -> None:
    # The forkserver's environment is the one it started with: the caller's, at launch, is the rank's.
    os.environ.clear()
    os.environ.update(env)
    # On a fatal signal, every thread's Python stack goes to a file the parent reads into its failure.
    faulthandler.enable(open(os.path.join(crash_dir, f"rank{rank}.txt"), "w"), all_threads=True)
    # So does what native code writes before it aborts (glibc: "malloc(): unaligned tcache chunk
    # detected"), which only fd 2 receives; the parent relays the file to its stderr (_relay_stderr).
    sys.stderr.flush()
    os.dup2(os.open(os.path.join(crash_dir, f"rank{rank}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Bytes, not tensors: a queued tensor lives in shared memory that dies with this process.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException as exc:  # report every failure to the parent, then exit
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    A rank that raises fails the caller with that rank's traceback; ranks that
    have not finished after ``timeout_s`` are killed and the caller fails, so a
    hang never outlives the test. A rank killed by a signal (a native crash:
    heap corruption, a segfault) fails the caller at once with the end of that
    rank's stderr (where glibc names the corruption) and every thread's Python
    stack in it: a crash is a defect to find, never retried. Each rank's stderr
    reaches this process's stderr when the run ends.
    """
    with tempfile.TemporaryDirectory(prefix="dpar-ranks-") as crash_dir:
        try:
            crashed, outcome = _run_once(fn, world_size, args, timeout_s, crash_dir)
        finally:
            _relay_stderr(crash_dir, world_size)
        if crashed is None:
            return outcome
        stacks = _read(os.path.join(crash_dir, f"rank{crashed}.txt"))
        native = _read(os.path.join(crash_dir, f"rank{crashed}.stderr"))[-2000:]
    raise RankFailed(
        f"rank {crashed} of {world_size} died of signal {-outcome}; the end of its stderr:\n{native}\nits stacks:\n{stacks}"
    )


def _relay_stderr(crash_dir: str, world_size: int) -> None:
    """Each rank's stderr (warnings, logs, a native abort's message) onto this process's, after the run."""
    for rank in range(world_size):
        text = _read(os.path.join(crash_dir, f"rank{rank}.stderr"), limit=None)
        if text.strip() and text != "(none written)":
            sys.stderr.write(f"--- rank {rank} stderr ---\n{text}")
    sys.stderr.flush()


def _read(path: str, limit: int | None = 8000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
            return text if limit is None else text[-limit:]
    except OSError:
        return "(none written)"


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float, crash_dir: str) -> tuple[int | None, Any]:
    """(None, results), or (the rank killed by a signal, minus its signal number), also when its peers
    reported the broken connection first."""
    ctx = RANK_CONTEXT
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, world_size, port, fn, args, queue, crash_dir, dict(os.environ)), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                silent = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if silent:
                    code = procs[silent[0]].exitcode
                    if code is not None and code < 0:
                        return silent[0], code
                    errors[silent[0]] = f"exited with code {code} without a result"
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise RankFailed(f"ranks {missing} did not finish within {timeout_s} s (hang?)")
                continue
            (results if status == "ok" else errors)[rank] = payload
    finally:
        killed = set()
        for rank, p in enumerate(procs):
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                killed.add(rank)
    if errors:
        # A crash often surfaces first as its peers' errors (gloo: "Connection reset by peer"); the
        # crashed rank, not its peers, is the failure to report.
        for rank, p in enumerate(procs):
            if rank not in killed and rank not in results and rank not in errors and (p.exitcode or 0) < 0:
                return rank, p.exitcode
        rank = min(errors)
        raise RankFailed(f"rank {rank} failed:\n{errors[rank]}")
    return None, [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
