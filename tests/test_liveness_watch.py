"""The heartbeat watcher in one process (runtime/liveness.py, [Note: a rank that vanishes]): a silent
peer ends this rank only while it waits, never while it compiles."""

from __future__ import annotations

import json
import time

import torch.distributed as dist
from torch._dynamo.callback import CallbackTrigger, callback_handler

from dpar.runtime import liveness


def _silent_peer_seen_from(monkeypatch, call) -> list[int]:
    """Exit codes ``liveness.watch`` asked for, called through ``call``, with rank 1 silent since 60 s."""
    store = dist.HashStore()
    store.set("dpar/heartbeat/1", json.dumps({"beat": 5, "step": 3, "phase": "forward"}))
    exits: list[int] = []
    monkeypatch.setattr(liveness.os, "_exit", exits.append)
    monkeypatch.setattr(liveness, "SILENT_AFTER_S", 0.0)
    monkeypatch.setattr(liveness, "_progress", liveness._Progress(step=3, phase="backward", changed_at=time.monotonic() - 60))
    monkeypatch.setattr(liveness, "_left", [])
    monkeypatch.setattr(liveness, "_watched", {})
    monkeypatch.setattr(liveness, "_main_idle", [True])
    call(lambda: liveness.watch(store, 0, 2))
    return exits


def test_a_silent_peer_ends_a_rank_that_waits(monkeypatch, capsys) -> None:
    assert _silent_peer_seen_from(monkeypatch, lambda watch: watch()) == [1]
    assert "dpar.RankLostError: rank 0 lost rank(s) [1] in the backward of step 3" in capsys.readouterr().err


def test_a_silent_peer_does_not_end_a_rank_that_compiles(monkeypatch, capsys) -> None:
    """Both compile the same graph, and a peer holding the GIL (a large compile(), a full collection)
    on a loaded machine is silent for seconds while alive: this rank waits at its checks instead. The
    main thread says it compiles (dpar's backend, lowering and checks; Dynamo's compile callbacks)."""

    def in_dpar(watch) -> None:
        with liveness.compiling():
            watch()

    def in_dynamo(watch) -> None:
        with liveness.compiling():
            pass  # dpar's backend has run once: Dynamo now tells dpar when it compiles
        with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0/0"):
            watch()

    for compiling in (in_dpar, in_dynamo):
        assert _silent_peer_seen_from(monkeypatch, compiling) == [], compiling.__name__
    assert _silent_peer_seen_from(monkeypatch, lambda watch: watch()) == [1]  # and after both, it watches again
    assert "RankLostError" in capsys.readouterr().err


def test_a_silent_peer_does_not_end_a_rank_that_computes_outside_any_wait(monkeypatch, capsys) -> None:
    """A peer that ended its program by os._exit (multiprocessing's children do) never marks itself as left; a rank
    still computing after its last step (comparing state dicts, 13 s on two cores) is blocked in no transport, and a
    gloo wait would stop its CPU clock: it must not end itself."""

    def computing(watch) -> None:
        liveness._main_idle[0] = False
        watch()

    assert _silent_peer_seen_from(monkeypatch, computing) == []
    assert "RankLostError" not in capsys.readouterr().err
    assert _silent_peer_seen_from(monkeypatch, lambda watch: watch()) == [1]  # blocked again: it watches
