"""Planning work run in forked processes beside the caller's, as many at once as cores and one more.

[Note: planning work in processes beside the caller's]
``dpar plan`` at real sizes spends most of its time on work that depends on nothing else of the plan once the
search has answered: the pipeline search, and each copy of the model that the count on the compiled graphs compiles
(api/graph_pricing.py). Tracing and compiling are Python and hold the GIL, so threads would not overlap them; each
job runs in a child forked from this process instead (the child inherits the model, its inputs and dpar's state, so
nothing is pickled on the way in) and sends back its result, a small picklable value (a dict of figures, a plan).
As many jobs run at once as this process may use cores, and one more (the caller only waits while they run; with one a
core, the last job ran alone on 2 cores while the other stood idle: Llama-3-70B's plan on 64 x 8 took 56.1 s, 52.6
with one more, 2026-11-30); the others wait their turn in the order they came.

A fork is used only where it is safe to use: on Linux, with no process group initialised (a live group's sockets
and threads are not the child's to touch), and with two cores or more. Elsewhere a job runs in the caller's process
when its result is asked for, which gives the same values. The child runs torch on one intra-op thread (OpenMP's
pool is not fork-safe once the parent has used it; the jobs trace and count on fake tensors and time no kernel), sends
its warnings back with its result (the caller re-issues them under its own filters) and leaves by ``os._exit``,
running none of the parent's exit handlers. Its error is raised in the caller, the child's traceback as its cause.
A child that dies without answering is an error naming its exit status; one whose CPU time stops advancing for
``STALLED_S`` (a deadlock, which a fork can cause) is killed, and its job runs in the caller's process, with a
warning saying so: a plan is never lost to a hang.
torch refuses autograd in a process forked from one whose autograd engine started its device threads ("Unable to
handle autograd's threading in combination with fork-based multiprocessing"; seen with torch 2.14.1's CUDA build, on
a machine without GPUs, once a backward ran in the parent). Nothing in torch's Python API tells the parent so
beforehand, and AOTAutograd's trace runs autograd, so each child first runs a backward of one scalar; a child refused
there answers so before its job starts, and from then on every job of the plan runs in the caller's process, with one
warning saying why (planning in a fresh process, such as ``dpar plan``'s, keeps the forks).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

STALLED_S = 30.0  # a child whose CPU time has not moved for this long is taken as deadlocked
_AUTOGRAD_REFUSED = "autograd refused"  # a child's answer where torch refuses it autograd (see the Note)
_POLL_S = 1.0


class _ChildTraceback(Exception):
    """The traceback of an error raised in a child, as text: the cause of the error re-raised in the caller."""


@dataclasses.dataclass(eq=False)
class Job(Generic[T]):
    """One piece of work and, once it ran, its outcome."""

    name: str
    work: Callable[[], T]
    nice: int = 0  # added to the child's niceness: a job that may turn out unneeded yields the cores to the others
    pid: int | None = None
    reader: Connection | None = None
    cpu: tuple[float, float] = (-1.0, 0.0)  # the child's CPU seconds last seen, and when they last moved
    exit_status: int | None = None  # the child's, once reaped before it answered
    outcome: tuple[str, Any, list[Any]] | None = None  # ("value" | "error", the value or error, warnings)
    seconds: float = 0.0  # how long the work ran, in its process


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def forking_allowed() -> bool:
    """Whether jobs run in forked children here (see the Note)."""
    live = dist.is_available() and dist.is_initialized()
    return sys.platform == "linux" and hasattr(os, "fork") and not live and cores() >= 2


class SideProcesses:
    """Jobs run in forked children, at most ``processes`` at once (by default the cores and one more: see the Note);
    ``processes=1`` (or where forking is not allowed) runs each job in the caller's process when its result is asked
    for."""

    def __init__(self, processes: int | None = None) -> None:
        self.processes = cores() + 1 if processes is None else processes
        self.forks = self.processes > 1 and forking_allowed()
        self._queue: list[Job[Any]] = []
        self._running: list[Job[Any]] = []
        self.finished: list[Job[Any]] = []  # the jobs a child ran to the end, in the order they ended

    def submit(self, name: str, work: Callable[[], T], nice: int = 0) -> Job[T]:
        """``work`` queued, and started now if fewer than ``processes`` jobs run (``nice``: its child's niceness
        raised by that much)."""
        job: Job[T] = Job(name, work, nice)
        self._queue.append(job)
        self._start_queued()
        return job

    def result(self, job: Job[T]) -> T:
        """``job``'s value (its error raised, its warnings issued here), waiting for it and starting queued jobs as
        running ones end."""
        if job.outcome is None and job not in self._queue and job not in self._running:
            raise RuntimeError(f"{job.name} was cancelled: it has no result")
        while job.outcome is None:
            if not self.forks and job in self._queue:
                self._queue.remove(job)
                job.outcome = _run_here(job)
                break
            self._start_queued()
            ready = wait([j.reader for j in self._running if j.reader is not None], timeout=_POLL_S)
            for running in list(self._running):
                if running.reader in ready or self._exited_or_stalled(running):
                    self._finish(running)
        kind, value, caught = job.outcome
        for message, category, filename, lineno in caught:
            warnings.warn_explicit(message, category, filename, lineno)
        if kind == "error":
            raise value
        return value

    def cancel(self, *jobs: Job[Any]) -> None:
        """``jobs`` dropped: queued ones never start, running ones are killed."""
        for job in jobs:
            if job in self._queue:
                self._queue.remove(job)
            if job in self._running:
                _kill(job)
                self._running.remove(job)

    def close(self) -> None:
        """Every job not yet finished cancelled (a child never outlives the plan that started it)."""
        self.cancel(*self._queue, *self._running)

    def __enter__(self) -> SideProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_queued(self) -> None:
        while self.forks and self._queue and len(self._running) < self.processes:
            job = self._queue.pop(0)
            job.reader, writer = Pipe(duplex=False)
            gc.freeze()  # the child's collector then leaves the inherited objects, and their pages, untouched
            with warnings.catch_warnings():  # Python 3.12+ warns of a deadlock in the child: handled (see the Note)
                warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # the child: never returns
                job.reader.close()
                _child(job, writer)
            gc.unfreeze()
            writer.close()
            job.pid = pid
            self._running.append(job)

    def _fork_no_more(self, job: Job[Any], refusal: str) -> None:
        """``job``, whose child torch refused autograd, run here, and every later job too (see the Note)."""
        if self.forks:
            warnings.warn(f"{job.name}: torch refuses autograd in a process forked from this one ({refusal}); the "
                          "planning work runs in this process instead, one job after another. Planning before this "
                          "process runs a backward, or in a fresh process (`dpar plan`), runs it beside the caller's",
                          RuntimeWarning, stacklevel=4)
            self.forks = False
        job.outcome = _run_here(job)

    def _exited_or_stalled(self, job: Job[Any]) -> bool:
        """Whether ``job``'s child exited (its answer, if any, is in the pipe) or stalled (see the Note)."""
        assert job.pid is not None
        pid, status = os.waitpid(job.pid, os.WNOHANG)
        if pid:
            job.pid, job.exit_status = None, status  # reaped
            return True
        cpu, now = _cpu_seconds(job.pid), time.monotonic()
        if cpu is None or cpu > job.cpu[0]:
            job.cpu = (cpu if cpu is not None else job.cpu[0], now)
            return False
        return now - job.cpu[1] > STALLED_S

    def _finish(self, job: Job[Any]) -> None:
        """``job``'s outcome from its child: its answer, the error of a child that ended without one, or (a child
        whose CPU time stood still) the job run here."""
        self._running.remove(job)
        self.finished.append(job)
        assert job.reader is not None
        ended = job.pid is None
        if job.reader.poll(0):
            try:
                kind, value, caught, job.seconds, told = job.reader.recv()
                if told:  # pickling drops an error's cause and traceback: the child's is the cause
                    value.__cause__ = _ChildTraceback(told)
            except EOFError:  # the child closed the pipe without answering
                ended = True
            except Exception as error:  # noqa: BLE001 - a value that cannot be read back is the job's error
                job.outcome = ("error", RuntimeError(f"{job.name}: its result could not be read back from the "
                                                     f"process that computed it ({type(error).__name__}: {error})"), [])
            else:
                if kind == _AUTOGRAD_REFUSED:
                    _kill(job)
                    self._fork_no_more(job, value)
                    return
                job.outcome = (kind, value, caught)
            if job.outcome is not None:
                _kill(job)
                return
        if not ended:  # alive, its CPU time still: deadlocked
            _kill(job)
            warnings.warn(f"{job.name}: the forked process computing it made no progress for {STALLED_S:.0f} s and "
                          "was stopped; computing it in this process instead", RuntimeWarning, stacklevel=3)
            job.outcome = _run_here(job)
            return
        if job.pid is not None:
            job.exit_status = os.waitpid(job.pid, 0)[1]
            job.pid = None
        _kill(job)
        status = job.exit_status or 0
        how = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exit code {os.waitstatus_to_exitcode(status)}")
        job.outcome = ("error", RuntimeError(
            f"{job.name}: the forked process computing it ended without a result ({how}; its stderr says why)"), [])


def _run_here(job: Job[T]) -> tuple[str, Any, list[Any]]:
    """``job`` run in this process: its outcome, its error kept for whoever asks for its result."""
    start = time.perf_counter()
    try:
        return ("value", job.work(), [])
    except Exception as error:  # noqa: BLE001 - raised by ``result`` for this job, not for whichever was awaited
        return ("error", error, [])
    finally:
        job.seconds = time.perf_counter() - start


def _autograd_refusal() -> str | None:
    """torch's message where it refuses autograd in this process, else None (see the Note)."""
    scalar = torch.ones((), requires_grad=True)
    try:
        torch.autograd.grad(scalar * 2, scalar)
    except RuntimeError as error:
        return str(error)
    return None


def _child(job: Job[Any], writer: Connection) -> None:
    """Run ``job`` and send its outcome, ``(kind, value or error, warnings, seconds, the error's traceback)``; then
    leave without cleanup. A child torch refuses autograd answers ``_AUTOGRAD_REFUSED`` and why, before the job."""
    code = 0
    try:
        torch.set_num_threads(1)
        refusal = _autograd_refusal()
        if refusal is not None:
            writer.send_bytes(pickle.dumps((_AUTOGRAD_REFUSED, refusal, [], 0.0, "")))
            return
        if job.nice:
            os.nice(job.nice)
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the caller's filters decide when it re-issues them
            told = ""
            try:
                outcome: tuple[str, Any] = ("value", job.work())
            except Exception as error:  # noqa: BLE001 - sent to the caller, which raises it
                outcome, told = ("error", error), "".join(traceback.format_exception(error))
        found = [(str(w.message), w.category, w.filename, w.lineno) for w in caught]
        seconds = time.perf_counter() - start
        try:
            payload = pickle.dumps((*outcome, found, seconds, told))
        except Exception as error:  # noqa: BLE001 - an error (or value) that does not pickle is sent as text
            text = f"{type(outcome[1]).__name__}: {outcome[1]}" if outcome[0] == "error" else f"{error}"
            payload = pickle.dumps(("error", RuntimeError(f"{job.name}: {text}"), found, seconds, told))
        writer.send_bytes(payload)
    except BaseException:  # noqa: BLE001 - nothing may escape into the parent's stack in this process
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _kill(job: Job[Any]) -> None:
    if job.pid is not None:
        try:
            os.kill(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(job.pid, 0)
        job.pid = None
    if job.reader is not None:
        job.reader.close()
        job.reader = None


def _cpu_seconds(pid: int) -> float | None:
    """The user and system CPU seconds process ``pid`` has used, from /proc (None where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


__all__ = ["Job", "STALLED_S", "SideProcesses", "forking_allowed"]
