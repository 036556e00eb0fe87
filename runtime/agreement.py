"""Cross-rank agreement on what each rank is about to communicate.

[Note: why agree through the store]
A collective issued by one rank and not by another hangs both. Before a newly
compiled graph runs its first collective, every rank publishes a fingerprint
of its collective sequence under a numbered key in the rendezvous store and
reads the others' with a timeout. The store never blocks a rank forever, so a
rank that diverged (or never arrives) turns into an error that shows the first
difference, not a hang.
"""

from __future__ import annotations

import itertools
import json
import time

import torch.distributed as dist

from dpar.core.errors import CollectiveMismatchError, DivergedRanksError
from dpar.runtime import liveness
from dpar.runtime.peer_progress import POLL_INTERVAL_S, PeerReport, ask, start_answering
from dpar.core.world import World, collectives_issued, default_store, global_rank, wait_for_keys


_checks_started = 0
# A rank that has not arrived after this long is asked where it is, and again after each answer.
_ASK_AFTER_S = 1.0


@liveness.compiling()  # a check is not a stall: see [Note: a rank that vanishes]
def agree(
    world: World,
    what: str,
    lines: list[str],
    timeout_s: float,
    *,
    subject: str = "collective sequences",
    within: list[tuple[str, list[int]] | None] | None = None,
) -> None:
    """Raise unless every rank of ``world`` passes the same ``lines`` for its n-th check.

    ``what`` names the graph being checked; ``subject`` what the lines describe.
    ``within`` (one entry per line, or None) adds to a line a detail that only the
    ranks listed with it must agree on: see [Note: what only a sub-group agrees on].
    """
    global _checks_started
    liveness.record_location()
    seq = _checks_started
    _checks_started += 1
    start_answering(dist.get_rank(), lambda: _checks_started)
    store = default_store()
    prefix = f"dpar/agree/{world.group_name}/{seq}"
    within = within if within is not None else [None] * len(lines)
    store.set(f"{prefix}/{world.rank}", json.dumps({"what": what, "lines": lines, "within": within}))
    keys = [f"{prefix}/{r}" for r in range(world.size)]
    _wait_for_ranks(store, keys, world, f"{what} (check #{seq})", timeout_s)
    for other in range(world.size):
        if other == world.rank:
            continue
        theirs = json.loads(store.get(keys[other]))
        if theirs["lines"] != lines or theirs["what"] != what:
            raise CollectiveMismatchError(
                _describe_difference(
                    subject, world.rank, what, lines, other, theirs["what"], theirs["lines"]
                )
            )
        peer = global_rank(world, other)
        shared = [w is not None and peer in w[1] for w in within]  # the lines agree, so the groups' sizes do
        mine_in = [_with_detail(line, w, s) for line, w, s in zip(lines, within, shared)]
        theirs_in = [_with_detail(line, w, s) for line, w, s in zip(theirs["lines"], theirs["within"], shared)]
        if mine_in != theirs_in:
            raise CollectiveMismatchError(
                _describe_difference(subject, world.rank, what, mine_in, other, theirs["what"], theirs_in)
            )


# [Note: what only a sub-group agrees on]
# A collective over a sub-group of a mesh (fsdp's gather over the dp axis of a
# 2-D mesh) must have the same shape on the ranks of that group only. Ranks at
# another position on the other axis run their own copy of it over their own
# group, and where tensor parallel splits a dimension unevenly (a vocabulary of
# 101 over 2 ranks: blocks of 51 and 50 rows) its shape legitimately differs
# there. So every rank agrees on the sequence of kinds, dtypes and group sizes,
# and a pair of ranks compares shapes where it shares the group.


def _with_detail(line: str, within: list | None, shared: bool) -> str:
    """``line`` with its sub-group detail where both ranks are in that group (the detail is then compared too)."""
    return f"{line} {within[0]}" if shared and within is not None else line


def _wait_for_ranks(store: dist.Store, keys: list[str], world: World, check: str, timeout_s: float) -> None:
    """Return once every rank has published ``keys``; raise when one is known never to come, or at the timeout.

    See [Note: telling a late rank from a diverged one] in ``peer_progress.py``.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    earlier: dict[int, PeerReport] = {}
    while True:
        if wait_for_keys(store, keys, min(_ASK_AFTER_S, max(0.0, deadline - time.monotonic()))):
            return
        missing = [global_rank(world, r) for r, k in enumerate(keys) if not store.check([k])]
        if time.monotonic() >= deadline:
            raise CollectiveMismatchError(
                f"rank {dist.get_rank()} compiled {check} but rank(s) {missing} did not reach the same "
                f"check within {timeout_s:.0f} s{_whereabouts(earlier, missing)}: the ranks run different "
                "code paths (a graph break or recompile on some ranks only?). Make the model's control "
                "flow identical on every rank."
            )
        reports = ask(missing, min(2 * POLL_INTERVAL_S, max(0.0, deadline - time.monotonic())))
        mine = collectives_issued()
        blocked = [
            report for rank, report in reports.items()
            if report.ahead_of(mine) and rank in earlier and earlier[rank].collectives == report.collectives
        ]
        if blocked:
            raise DivergedRanksError(_describe_blocked(check, blocked, mine, time.monotonic() - start))
        earlier = reports


def _whereabouts(reports: dict[int, PeerReport], missing: list[int]) -> str:
    known = [f"rank {r} at {reports[r].where}, {reports[r].checks} checks started" for r in missing if r in reports]
    return f" ({'; '.join(known)})" if known else ""


def _describe_blocked(check: str, blocked: list[PeerReport], mine: dict[str, int], waited_s: float) -> str:
    lines = [
        f"  rank {b.rank} (at {b.where}): collective #{theirs} issued on group {group}, where rank "
        f"{dist.get_rank()} has issued {ours}, and no further collective since"
        for b in blocked
        for group, (theirs, ours) in list(b.ahead_of(mine).items())[:1]
    ]
    return (
        f"rank {dist.get_rank()} compiled {check}, which communicates, and waits for the other ranks to "
        f"compile it too; but rank(s) {[b.rank for b in blocked]} will not come (seen after {waited_s:.1f} s):\n"
        + "\n".join(lines)
        + "\nThey wait inside a collective this rank would issue only after the check: they run a graph "
        "this rank does not. A graph that needs every rank was compiled on some ranks only: evaluation or "
        "generation on rank 0 alone under zero2/fsdp/hsdp/tp (parameters are sharded or split, so even a "
        "forward gathers them), a forward with grad enabled and buffers under ddp, or a recompile on one "
        "rank (a batch of another shape). Fix: run the evaluation on every rank (each on its own slice); "
        "under ddp, run it under torch.no_grad(), which compiles a graph without collectives; or call "
        "state = dpar.checkpoint.full_state_dict(model) on every rank and evaluate a plain, uncompiled "
        "copy of the model that loads it on rank 0."
    )


def _describe_difference(
    subject: str,
    rank: int, what: str, lines: list[str], other: int, their_what: str, their_lines: list[str]
) -> str:
    for i, (mine, theirs) in enumerate(itertools.zip_longest(lines, their_lines)):
        if mine != theirs:
            break
    return (
        f"{subject} differ between ranks, which would hang or corrupt gradients.\n"
        f"  rank {rank}: {what}, {len(lines)} entries; rank {other}: {their_what}, "
        f"{len(their_lines)} entries\n"
        f"  first difference at #{i}:\n"
        f"    rank {rank}: {mine or '<none>'}\n"
        f"    rank {other}: {theirs or '<none>'}\n"
        "Every rank must run the same model code with parameters of the same shapes: check "
        "rank-dependent branches in forward() and how the model is built."
    )
