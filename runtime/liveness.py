"""A rank that vanishes: heartbeats, the step each rank is at, and the error the survivors raise.

[Note: a rank that vanishes]
A rank killed in the middle of a step (SIGKILL, OOM killer, a lost host) leaves the others inside,
or about to enter, a collective with it. What a survivor sees depends on how it died:

* The process died and its kernel closed its sockets (SIGKILL, a crash): gloo fails the survivor's
  pending or next collective at once (10-20 ms measured), with a transport message that names an
  address, not a rank. dpar catches the failure where its compiled graphs are called
  (``Watched``) and finds the vanished rank from heartbeats: every rank's daemon thread (the one of
  peer_progress.py) bumps a counter in the rendezvous store once a second, whatever its main thread
  is doing, and a rank that leaves on purpose overwrites it with why. A counter that does not move
  for ``LOST_AFTER_S`` (three beats: a loaded machine can delay one beat, not three) belongs to a
  rank that is gone. The survivor then raises ``RankLostError`` naming that rank, its last known
  step and this rank's step. Bound: the failed collective's error plus ``LOST_AFTER_S``, about 3 s.
  A survivor computing when the rank died meets the failure at its next collective, at most one
  step later.
* The process stopped without closing its sockets (a host that lost power or network, a frozen
  process): gloo waits for the process group's timeout (30 min by default), and no Python code can
  interrupt a thread blocked in the transport (``ProcessGroupGloo.abort`` does not release it,
  checked on torch 2.13). The same daemon thread watches: once this rank's graphs have made no
  progress for ``WATCH_AFTER_S``, it reads the others' heartbeats each second; a rank whose counter
  stays still for ``SILENT_AFTER_S`` is declared lost, and the thread prints the ``RankLostError``
  message and ends this process with exit code 1, as NCCL's own watchdog does with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING``. On gloo, where a blocked wait stops the main thread's CPU
  clock, a rank whose main thread computes (outside dpar's graphs: evaluation, comparing state dicts)
  is not blocked and does not watch: a peer that ended its program early (a process ended by
  ``os._exit``, as multiprocessing's children are, never marks itself as left) once ended a live
  rank comparing results 13 s after its last step. Bound: ``WATCH_AFTER_S + SILENT_AFTER_S`` plus one beat,
  about 14 s; ``SILENT_AFTER_S`` is longer than ``LOST_AFTER_S`` because ending a process is final,
  and a live rank whose threads are starved (swapping, a C call holding the GIL) must not be taken
  for dead. Nor does the thread watch while this rank compiles (Dynamo's or AOTAutograd's compile,
  dpar's passes or a check across ranks, as its main thread records it): a compiling rank is blocked
  in no transport, its checks wait with their own bounds and named errors, and its peers compile
  the same graph, holding the GIL for long stretches (Python's compile() of a large generated
  graph, a full garbage collection). On a machine with ten runnable threads per core that silenced
  a live peer's heartbeat for 10 s while both compiled, and the rank that watched ended itself
  with a RankLostError naming a rank that was alive.
* A survivor blocked on a live rank that is itself blocked on the vanished one is released when
  that rank leaves by either path (its sockets close), so every survivor is out within the bounds
  above; each also watches the vanished rank's heartbeat itself.

[Note: ranks alive but stuck in different collectives]
Every rank alive and beating, yet one blocked for good in a collective wait: the collective it waits
for was paired with another one on a peer (gloo pairs a group's collectives by the order they are
issued, so a collective issued on some ranks only, or two issued in another order, shifts every
later pairing; a pair of different sizes never completes), or its transport lost it. Gloo alone
would wait the process group's timeout (30 min by default), spinning or not, with no error.

The heartbeat tells it: it carries this rank's collectives issued per group (c10d's sequence
numbers, as in peer_progress.py) and whether the main thread is blocked inside a dpar graph (it is
inside one and its CPU clock stood still since the last beat: a collective's wait). A rank blocked
so, whose counts have not moved for
``STALLED_AFTER_S``, while every other rank is alive and has issued at least as many collectives on
every group they share and none since, waits for a collective every member of its group has issued:
nothing it waits for can still be on its way, so the pairing is wrong. It prints
``CollectiveStallError`` with the counts and where each rank is, marks itself as left, and ends its
process (a blocked wait cannot be interrupted); its peers' collectives then fail and they raise
``RankLostError`` naming it and why. A rank behind a peer never declares (the peer is waiting for
it: it may be late), so a slow rank is never taken for a stuck one; the rank furthest behind is the
one that declares. Bound: ``WATCH_AFTER_S + STALLED_AFTER_S`` plus two beats, about 34 s; longer
than ``SILENT_AFTER_S`` because one collective of several GB on a slow link can legitimately take
ten seconds or more. Not watched: pipeline steps (point-to-point transfers between two ranks leave
the group counts of the others behind, legitimately), and NCCL, whose waits do not block the CPU.

On NCCL the survivor's CPU does not block inside the graph (kernels wait on the GPU) but at its
next synchronisation, outside dpar's graphs, where the same watchdog sees no graph progress and acts
alike. NCCL's own watchdog is the second line: ``NCCL_DEFAULTS`` below are set when dpar is imported
(before ``init_process_group`` reads them; a value already in the environment, the user's or
torchrun's, wins). Not tested here: no GPU on the machine these notes were written on.

Steps are counted here, not by the optimizer, which dpar does not see: a step begins with the
first forward graph call after a backward (or a no_grad inference graph), so under gradient accumulation each
micro-batch counts as one. The heartbeat carries the step and phase, so the survivor can say where
the vanished rank was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func

from dpar.core.errors import CollectiveStallError, RankLostError
from dpar.core.torch_internals import dynamo_compile_callbacks
from dpar.core.world import collectives_issued, default_store

_HEARTBEAT = "dpar/heartbeat"
_LIBRARY_DIRS = (  # frames that are not the user's code: torch's, dpar's, and Python's own (contextlib's ``with``)
    os.path.dirname(torch.__file__),
    *(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) for d in ("api", "compiler", "runtime")),
    sysconfig.get_path("stdlib"),
)
LOST_AFTER_S = 3.0
"""After a collective failed: a rank whose heartbeat does not move for this long is gone (three beats)."""
WATCH_AFTER_S = 3.0
"""This rank's graphs made no progress for this long: the daemon thread starts reading the others' heartbeats."""
SILENT_AFTER_S = 10.0
"""While watching: a rank whose heartbeat stays still this long is declared lost, and this process ends."""
STALLED_AFTER_S = 30.0
"""While watching: blocked in a wait, every rank alive and past this rank's collectives, none issuing
another for this long: the collectives are mismatched, and this process ends. See [Note: ranks alive
but stuck in different collectives]."""


NCCL_DEFAULTS = {
    # A failed or timed-out collective ends the process, without the communicator clean-up that can
    # itself hang on a dead peer (torch's default, pinned: torchrun sets 1, which cleans up first).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # The rank whose watchdog sees the error tells the others through the store: they end too, rather
    # than each waiting for its own timeout (the process group's, 10 min by default).
    "TORCH_NCCL_PROPAGATE_ERROR": "1",
    # A watchdog thread itself stuck in a CUDA or NCCL call is ended by the monitor after
    # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (torch's 480 s).
    "TORCH_NCCL_ENABLE_MONITORING": "1",
}
for _name, _value in NCCL_DEFAULTS.items():
    os.environ.setdefault(_name, _value)


@dataclasses.dataclass
class _Progress:
    """Where this rank's main thread is, as far as dpar's compiled graphs tell."""

    step: int = 0
    phase: str = "start"  # the role of the graph called last: forward, backward, inference
    changed_at: float = dataclasses.field(default_factory=time.monotonic)
    inside: bool = False  # the main thread is inside a compiled graph now
    compiling: int = 0  # compiles and checks across ranks the main thread is inside now (nested)
    dynamo_compiling: bool = False  # between Dynamo's compile-start and compile-end callbacks
    location: str = "an unknown place"  # the user code from which the main thread last entered a graph or a check

    def where(self) -> str:
        if self.step == 0:
            return "before the first step"
        if self.phase == PIPELINE_STEP:
            return f"in pipeline step {self.step}"
        if self.phase == "inference":
            return f"in an inference graph (no_grad) after step {self.step}"
        return f"in the {self.phase} of step {self.step}"


_progress = _Progress()
_watched: dict[int, tuple[int, float]] = {}  # rank -> (its heartbeat count, when this rank saw it change)
_left: list[str] = []  # why this rank left, once it has: the first reason stays
# rank -> (its collectives issued, as a JSON string, and since when it has shown those); this rank's
# own entry only while its main thread is blocked in a wait.
_issued_since: dict[int, tuple[str, float]] = {}


PIPELINE_STEP = "pipeline step"  # one call of dpar.pipeline's step: forward and backward of every micro-batch


def _enter(phase: str) -> None:
    if phase == PIPELINE_STEP or (phase == "forward" and _progress.phase != "forward"):
        _progress.step += 1
    if phase != _progress.phase:  # a few times a step: the walk costs microseconds
        record_location()
    _progress.phase, _progress.changed_at = phase, time.monotonic()


# [Note: no thread reads another thread's frames]
# The daemon thread (peer_progress.py) used to find where the main thread was by walking its frames
# (``sys._current_frames()`` and ``f_back``): the user code it was in, whether it was compiling, the
# graph line at which it waited. Under torch.compile that is not safe. Frames that Dynamo runs or is
# compiling are not plain interpreter frames, and a frame object made for one from another thread can
# outlive it: ``benchmarks/frame_walk_crash.py`` (no dpar: a model under torch.compile, recompiled
# now and then, and a thread walking the main thread's frames) died of SIGSEGV inside ``f_back`` in
# 4 of 5 runs of 90-120 s on torch 2.13 and Python 3.11, and in none without the walking thread.
# So the main thread says where it is itself, in ``_progress``: the user code it entered a graph or a
# check from (``record_location``, walking its own frames, on a phase change and at each check), and
# whether it compiles (``compiling()`` around dpar's backend, its lowering and its checks, and
# Dynamo's own compile callbacks). Whether it waits for a collective is read from its CPU clock
# (``_main_thread_idle``), which the kernel keeps for every thread: a thread blocked in a wait uses
# none, one that computes uses most of a core.


def record_location(depth: int = 3) -> None:
    """Remember the innermost ``depth`` frames of user code on the main thread (not torch's, dpar's or
    generated code). Called on the main thread only: see [Note: no thread reads another thread's frames]."""
    if threading.current_thread() is not threading.main_thread():
        return
    frame: Any = sys._getframe(1)
    user: list[str] = []
    while frame is not None and len(user) < depth:
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARY_DIRS) and not filename.startswith("<"):
            user.append(f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    _progress.location = " -> ".join(reversed(user)) or "an unknown place"


def where_recorded() -> str:
    """The user code from which the main thread last entered a graph or a check (its own record)."""
    return _progress.location


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """The main thread compiles a graph or waits at a check across ranks: its peers are not watched
    meanwhile (see [Note: a rank that vanishes])."""
    _follow_dynamo_compiles()
    _progress.compiling += 1
    try:
        yield
    finally:
        _progress.compiling -= 1


def _dynamo_started(_: Any) -> None:
    _progress.dynamo_compiling = True


def _dynamo_ended(_: Any) -> None:
    _progress.dynamo_compiling = False


def _follow_dynamo_compiles() -> None:
    """Have Dynamo say when it compiles (its frames' tracing, AOTAutograd's lazy backward): registered
    again after ``torch._dynamo.reset()``, which clears the callbacks."""
    if _dynamo_started not in dynamo_compile_callbacks.start_callbacks:
        dynamo_compile_callbacks.register_start_callback(_dynamo_started)
        dynamo_compile_callbacks.register_end_callback(_dynamo_ended)


def _compiling() -> bool:
    return _progress.compiling > 0 or _progress.dynamo_compiling


class Watched:
    """A compiled graph (boxed calling convention) that counts steps and turns a failed collective
    into ``RankLostError`` when a rank has vanished. See [Note: a rank that vanishes]."""

    def __init__(self, compiled: Callable[..., Any], phase: str) -> None:
        self._boxed_call = True
        self._compiled = compiled if getattr(compiled, "_boxed_call", False) else make_boxed_func(compiled)
        self._phase = phase

    def __call__(self, args: list[Any]) -> Any:
        with watching(self._phase):
            return self._compiled(args)


@contextlib.contextmanager
def watching(phase: str) -> Iterator[None]:
    """Count the step; a collective failing inside becomes ``RankLostError`` when a rank has vanished."""
    _enter(phase)
    _progress.inside = True
    try:
        yield
    except RuntimeError as exc:  # gloo's and NCCL's failures (DistBackendError is one)
        error = _diagnose(exc)
        if error is None:
            raise
        raise error from exc
    finally:
        _progress.inside = False
        _progress.changed_at = time.monotonic()


# Heartbeats: written and watched by peer_progress.py's daemon thread on its own store connection.


def beat(store: dist.Store, rank: int, count: int) -> None:
    _waiting[0] = _blocked_in_wait()
    heartbeat = {"beat": count, "step": _progress.step, "phase": _progress.phase, "waiting": _waiting[0]}
    issued = _issued()
    if issued is not None:
        heartbeat["issued"] = issued
    store.set(f"{_HEARTBEAT}/{rank}", json.dumps(heartbeat))


def _issued() -> dict[str, int] | None:
    """``collectives_issued()``; None while the main thread changes c10d's table of groups (new_group)."""
    try:
        return collectives_issued()
    except RuntimeError:  # the table changed size while read
        return None


_waiting = [""]  # what the main thread waits for, as of the last beat ("" if it does not)
_main_idle = [True]  # whether the main thread used almost no CPU over the last beat (unknown before one: idle)
_IDLE_CPU_FRACTION = 0.05
_main_cpu: list[tuple[float, float]] = []  # (wall clock, the main thread's CPU seconds) at the last beat


def _main_thread_idle() -> bool:
    """Whether the main thread used almost no CPU since the last beat: blocked (a collective's wait), not
    computing. See [Note: no thread reads another thread's frames]."""
    try:
        cpu = time.clock_gettime(time.pthread_getcpuclockid(threading.main_thread().ident))
    except (AttributeError, OSError):  # no per-thread CPU clock here: never taken for blocked
        return False
    wall = time.monotonic()
    last = _main_cpu[-1] if _main_cpu else None
    _main_cpu[:] = [(wall, cpu)]
    return last is not None and cpu - last[1] < _IDLE_CPU_FRACTION * (wall - last[0])


def _blocked_in_wait() -> str:
    """What the main thread waits for inside a dpar graph ("a collective in the backward graph"), "" if
    it is not inside one, or computes there (its CPU clock moved since the last beat)."""
    idle = _main_idle[0] = _main_thread_idle()  # sampled every beat, so the interval is one beat
    if not _progress.inside or _progress.phase == PIPELINE_STEP or not idle:
        return ""
    return f"a collective in the {_progress.phase} graph"


def mark_left(store: dist.Store, rank: int, why: str) -> None:
    """This rank leaves on purpose (a finished program, a raised error): others must not wait for its heartbeat."""
    if _left:
        return
    _left.append(why)
    try:
        store.set(f"{_HEARTBEAT}/{rank}", json.dumps({"left": why}))
    except Exception:
        pass  # the store is gone with its host; the others find out from it


def _heartbeats(store: dist.Store, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The ranks' last heartbeats (a rank that never beat is absent): one round trip once all have beaten."""
    keys = [f"{_HEARTBEAT}/{r}" for r in ranks]
    if store.check(keys):
        return {r: json.loads(v) for r, v in zip(ranks, store.multi_get(keys))}
    return {r: json.loads(store.get(k)) for r, k in zip(ranks, keys) if store.check([k])}


def _waits_still() -> bool:
    """Whether a collective's wait stops the main thread's CPU clock: gloo's do; NCCL's survivor waits at its next
    synchronisation, which may spin (see [Note: a rank that vanishes])."""
    return not (dist.is_available() and dist.is_initialized()) or "nccl" not in str(dist.get_backend())


def _others(rank: int, world_size: int) -> list[int]:
    return [r for r in range(world_size) if r != rank]


def watch(store: dist.Store, me: int, world_size: int) -> None:
    """Run by the daemon thread once a second: end this process if it is stuck while a rank is silent."""
    now = time.monotonic()
    computing = not _main_idle[0] and _waits_still()  # outside any transport: a vanished peer fails its next collective
    if _progress.step == 0 or now - _progress.changed_at < WATCH_AFTER_S or _left or _compiling() or computing:
        _watched.clear()
        _issued_since.clear()
        return
    heartbeats = _heartbeats(store, _others(me, world_size))
    for rank, heartbeat in heartbeats.items():
        if "left" in heartbeat:
            _watched.pop(rank, None)
        elif rank not in _watched or _watched[rank][0] != heartbeat["beat"]:
            _watched[rank] = (heartbeat["beat"], now)
    silent = sorted(r for r, (_, since) in _watched.items() if now - since >= SILENT_AFTER_S)
    if not silent:
        _watch_for_stall(store, me, world_size, heartbeats, now)
        return
    message = (
        f"rank {me} lost rank(s) {silent} {_progress.where()}: they have sent no heartbeat for "
        f"{SILENT_AFTER_S:.0f} s while this rank has made no progress for {now - _progress.changed_at:.0f} s "
        "(their host is gone or the process is frozen). A collective blocked in the transport cannot be "
        f"interrupted, so dpar ends this process. {_RESTART}"
    )
    mark_left(store, me, f"lost rank(s) {silent}")
    print(f"dpar.RankLostError: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def _watch_for_stall(store: dist.Store, me: int, world_size: int, heartbeats: dict[int, dict[str, Any]], now: float) -> None:
    """End this process with ``CollectiveStallError`` if it waits for a collective that can no longer come.
    See [Note: ranks alive but stuck in different collectives]."""
    mine = _issued()
    if mine is None or dist.get_backend() != "gloo":  # NCCL's waits do not block the CPU; its watchdog times out
        return
    waiting = _waiting[0]
    issued = {me: mine} if waiting else {}
    issued.update({r: h["issued"] for r, h in heartbeats.items() if "issued" in h})
    for rank in list(_issued_since):
        if rank not in issued:
            del _issued_since[rank]
    for rank, counts in issued.items():
        key = json.dumps(counts, sort_keys=True)
        if rank not in _issued_since or _issued_since[rank][0] != key:
            _issued_since[rank] = (key, now)
    others = _others(me, world_size)
    if me not in issued or any(r not in issued or "left" in heartbeats.get(r, {}) for r in others):
        return
    if any(now - since < STALLED_AFTER_S for since in (_issued_since[r][1] for r in (me, *others))):
        return
    shared = {r: {g: (n, mine[g]) for g, n in issued[r].items() if g in mine} for r in others}
    if any(theirs < ours for groups in shared.values() for theirs, ours in groups.values()):
        return  # a peer is behind this rank: it is the one to tell (or it is late)
    lines = [
        f"  rank {r} ({_Progress(step=heartbeats[r]['step'], phase=heartbeats[r]['phase']).where()}, "
        + (f"blocked in {heartbeats[r]['waiting']}" if heartbeats[r].get("waiting") else "not in a wait") + "): "
        + ", ".join(f"{theirs} collectives issued on group {g}, this rank {ours}" for g, (theirs, ours) in groups.items())
        for r, groups in shared.items()
    ]
    stalled_s = now - max(since for _, since in _issued_since.values())
    message = (
        f"rank {me} is blocked in a collective {_progress.where()} (in {waiting}), and no rank has issued another for "
        f"{stalled_s:.0f} s, though every rank is alive and has issued at least the collectives this rank has:\n"
        + "\n".join(lines)
        + "\nThe collective this rank waits for was paired with a different one on another rank (gloo pairs a "
        "group's collectives in the order they are issued: one issued on some ranks only, or two issued in "
        "another order, mismatches every later pair), or its transport lost it. A collective blocked in the "
        "transport cannot be interrupted, so dpar ends this process. Look for collectives the program issues "
        "outside the compiled model on some ranks only (a stray dist.all_reduce, an evaluation on rank 0), "
        f"or a graph that differs between ranks. {_RESTART}"
    )
    mark_left(store, me, f"CollectiveStallError: blocked in a collective {_progress.where()}, every rank past it")
    print(f"dpar.{CollectiveStallError.__name__}: {message}", file=sys.stderr, flush=True)
    os._exit(1)


_QUOTED = 120  # characters of the transport's message quoted (gloo's first line names an address, then advice)
_RESTART = (
    "Training cannot go on with a rank missing: restart the job and resume from the last checkpoint "
    "(torchrun --max-restarts N ..., with dpar.checkpoint.load at start-up when a checkpoint exists; "
    "see the README's 'Failure behaviour')."
)


def _diagnose(exc: RuntimeError) -> RankLostError | None:
    """The error to raise for ``exc`` if a rank vanished or left; None if every rank is alive and in."""
    me = dist.get_rank() if dist.is_initialized() else None
    if me is None:
        return None
    failure = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:_QUOTED]}"
    others = _others(me, dist.get_world_size())
    try:
        store = default_store()
        first = _heartbeats(store, others)
        deadline = time.monotonic() + LOST_AFTER_S
        while True:
            now = _heartbeats(store, others)
            left = {r: h["left"] for r, h in now.items() if "left" in h}
            alive = {r for r, h in now.items() if "beat" in h and h["beat"] != first.get(r, {}).get("beat")}
            lost = [r for r in others if r not in left and r not in alive]
            if not lost or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    except Exception:  # the store no longer answers: its host is gone
        host = "the torchrun agent of rank 0's node" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
        return RankLostError(
            f"rank {me} lost the rendezvous store {_progress.where()} ({failure}): its host, {host}, is gone "
            f"(killed, crashed, or it left after an error of its own: see its log). {_RESTART}"
        )
    if not lost and not left:
        return None
    reasons = [
        f"rank {r} sent no heartbeat for {LOST_AFTER_S:.0f} s (killed or crashed; its last beat: "
        + (_Progress(step=first[r]["step"], phase=first[r]["phase"]).where() if "beat" in first.get(r, {}) else "none")
        + ")"
        for r in lost
    ] + [f"rank {r} left: {why}" for r, why in sorted(left.items())]
    named = lost or sorted(left)  # the vanished ranks; else those that left while this one communicated
    mark_left(store, me, f"lost rank(s) {named} {_progress.where()}")
    return RankLostError(
        f"rank {me} lost rank(s) {named} {_progress.where()}: a collective failed ({failure}); "
        f"{'; '.join(reasons)}. {_RESTART}"
    )
