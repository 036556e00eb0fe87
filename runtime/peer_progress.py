"""What a rank tells another rank that waits for it at a check.

[Note: telling a late rank from a diverged one]
A rank waiting at a check (``agreement.agree``) sees in the store only that
another rank has not arrived yet. That rank may be late (still computing,
loading data, compiling the same graph), or it may never come: it runs a graph
this rank does not (evaluation compiled on rank 0 only under fsdp, a recompile
on one rank) and waits inside that graph's collectives for this rank, which
issues its next collective only after the check.

The two differ in c10d's per-group sequence numbers (collectives issued). A
waiting rank has issued nothing since its last graph returned. A rank that has
issued more than it on a group both belong to has issued a collective the
waiting rank has not matched; if its counts also stay the same between two
answers a second apart, it is blocked there, and it cannot get out before the
waiting rank passes the check, which needs it: it will never come. A late rank
never has more. (A rank that issued an asynchronous collective out of order and
went on computing would look the same; dpar's graphs wait for theirs.)

Each rank runs one daemon thread, started at its first check, that looks for a
question in the store once a second on its own connection and answers with its
counts and where its main thread last said it was (it never reads the main
thread's frames: [Note: no thread reads another thread's frames] in
``liveness.py``): one store lookup a second per rank,
whatever the step time, and nothing added to a training step. A rank asks only
after waiting at a check for a second. The same thread publishes this rank's
heartbeat (one store write a second) and watches for a silent rank: see
[Note: a rank that vanishes] in ``liveness.py``.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import threading
from collections.abc import Callable

import torch.distributed as dist

from dpar.runtime import liveness
from dpar.core.world import collectives_issued, default_store, wait_for_keys

_QUERY_COUNT = "dpar/progress/queries"
_QUERY = "dpar/progress/query"
_ANSWER = "dpar/progress/answer"
# How often the answering thread looks for a question: one store lookup a second per rank, the
# cadence of torch's own NCCL watchdog (TORCH_NCCL_COORD_CHECK_MILSEC). A blocking store wait
# would send nothing, but it logs a warning with a C++ stack on every rank whose store server
# (rank 0) exits first, that is at the end of most runs.
POLL_INTERVAL_S = 1.0


@dataclasses.dataclass(frozen=True)
class PeerReport:
    """One rank's answer: collectives issued per group, checks started, where its main thread is."""

    rank: int
    collectives: dict[str, int]
    checks: int
    where: str

    def ahead_of(self, mine: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Shared groups on which this rank has issued more collectives than ``mine``: (theirs, mine)."""
        return {g: (n, mine[g]) for g, n in self.collectives.items() if g in mine and n > mine[g]}


_answering: threading.Thread | None = None
_stop = threading.Event()


def start_answering(rank: int, checks: Callable[[], int]) -> None:
    """Answer other ranks' progress queries from a daemon thread (one per process).

    ``rank`` is this process's default-group rank; ``checks`` counts the checks it has started.
    """
    global _answering
    if _answering is not None and _answering.is_alive():
        return
    try:
        store = default_store().clone()  # its own connection, usable beside the main thread's
    except Exception:  # a store without clone(): waiting ranks fall back to the check's timeout
        return
    _answering = threading.Thread(
        target=_answer_queries, args=(store, rank, dist.get_world_size(), checks), name="dpar-peer-progress", daemon=True
    )
    _answering.start()


@atexit.register
def _stop_answering() -> None:
    """A thread inside a store call while the interpreter finalizes aborts the process: stop it first."""
    _stop.set()
    if _answering is not None:
        _answering.join(timeout=2 * POLL_INTERVAL_S)


def _answer_queries(store: dist.Store, rank: int, world_size: int, checks: Callable[[], int]) -> None:
    query, beats = 1, 0
    try:
        # Ends with the process group: after destroy_process_group the store server may be gone.
        while True:
            beats += 1
            liveness.beat(store, rank, beats)
            liveness.watch(store, rank, world_size)
            while store.check([f"{_QUERY}/{query}"]):
                if rank in json.loads(store.get(f"{_QUERY}/{query}"))["ranks"]:
                    report = PeerReport(rank, collectives_issued(), checks(), liveness.where_recorded())
                    store.set(f"{_ANSWER}/{query}/{rank}", json.dumps(dataclasses.asdict(report)))
                query += 1
            if _stop.wait(POLL_INTERVAL_S) or not dist.is_initialized():
                break
    except Exception:
        pass  # the store is gone (an asking rank treats the silence as unknown), or the process group is
    finally:  # however the thread ends, others must not take the heartbeat's end for a vanished rank
        liveness.mark_left(store, rank, "its program ended or raised (see its log)")


def ask(ranks: list[int], timeout_s: float) -> dict[int, PeerReport]:
    """Reports from ``ranks`` (default-group ranks); a rank that does not answer within ``timeout_s`` is left out."""
    store = default_store()
    query = store.add(_QUERY_COUNT, 1)
    store.set(f"{_QUERY}/{query}", json.dumps({"ranks": ranks}))
    keys = {r: f"{_ANSWER}/{query}/{r}" for r in ranks}
    wait_for_keys(store, list(keys.values()), timeout_s)
    return {r: PeerReport(**json.loads(store.get(k))) for r, k in keys.items() if store.check([k])}
