"""tests/distributed.run_ranks on a rank that dies of a signal: the caller fails at once, with the rank's stacks."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from distributed import RankFailed, run_ranks


def _abort_rank_1_once(rank: int, world_size: int, marker: str) -> int:
    """Aborts only the first time: a harness that ran the ranks again would pass."""
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    return rank * 10


def _abort_rank_0_once_while_rank_1_waits(rank: int, world_size: int, marker: str) -> int:
    """Rank 1 blocks in a collective, so it reports the broken connection as its own error."""
    if rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(1.0)
        os.abort()
    dist.all_reduce(torch.ones(1))
    return rank * 10


def _native_message_then_abort(rank: int, world_size: int) -> int:
    """What glibc does on heap corruption: a line on fd 2, then SIGABRT."""
    if rank == 1:
        os.write(2, b"malloc(): unaligned tcache chunk detected\n")
        os.abort()
    return rank


def test_a_crash_carries_the_native_message_from_the_rank_s_stderr() -> None:
    with pytest.raises(RankFailed, match=r"(?s)died of signal 6; the end of its stderr:\nmalloc\(\): unaligned tcache.*its stacks:"):
        run_ranks(_native_message_then_abort, 2, timeout_s=120)


def test_a_rank_crashing_once_fails_the_caller_with_its_stack(tmp_path) -> None:
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 died of signal 6; the end of its stderr:.*its stacks:.*_abort_rank_1_once"):
        run_ranks(_abort_rank_1_once, 2, str(tmp_path / "crashed"), timeout_s=120)


def test_a_crash_reported_first_by_its_peer_is_named_as_the_crash(tmp_path) -> None:
    with pytest.raises(RankFailed, match=r"(?s)rank 0 of 2 died of signal 6; the end of its stderr:.*its stacks:.*_abort_rank_0_once"):
        run_ranks(_abort_rank_0_once_while_rank_1_waits, 2, str(tmp_path / "crashed"), timeout_s=120)
