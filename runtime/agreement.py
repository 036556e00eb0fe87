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

import datetime
import itertools
import json

import torch.distributed as dist

from dpar.runtime.errors import CollectiveMismatchError
from dpar.runtime.world import World


_check_counter = itertools.count()


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def agree(
    world: World, what: str, lines: list[str], timeout_s: float, *, subject: str = "collective sequences"
) -> None:
    """Raise unless every rank of ``world`` passes the same ``lines`` for its n-th check.

    ``what`` names the graph being checked; ``subject`` what the lines describe.
    """
    seq = next(_check_counter)
    store = _store()
    prefix = f"dpar/agree/{world.group_name}/{seq}"
    store.set(f"{prefix}/{world.rank}", json.dumps({"what": what, "lines": lines}))
    keys = [f"{prefix}/{r}" for r in range(world.size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the store raises its own timeout types
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise CollectiveMismatchError(
            f"rank {world.rank} compiled {what} (check #{seq}) but rank(s) {missing} did not "
            f"reach the same check within {timeout_s:.0f} s: the ranks run different code paths "
            "(a graph break or recompile on some ranks only?). Make the model's control flow "
            "identical on every rank."
        ) from exc
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
