"""tests/distributed.run_ranks on a rank that dies of a signal: one retry, then a named failure."""

from __future__ import annotations

import os

import time

import pytest
import torch
import torch.distributed as dist

from distributed import RankCrashRetried, RankFailed, run_ranks


def _abort_rank_1_once(rank: int, world_size: int, marker: str) -> int:
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


def _abort_rank_1_always(rank: int, world_size: int) -> int:
    if rank == 1:
        os.abort()
    return rank


def test_a_rank_crashing_once_is_run_again_with_a_warning_carrying_its_stack(tmp_path) -> None:
    with pytest.warns(RankCrashRetried, match=r"(?s)rank 1 of 2 died of signal 6 \(attempt 1\).*_abort_rank_1_once"):
        assert run_ranks(_abort_rank_1_once, 2, str(tmp_path / "crashed"), timeout_s=120) == [0, 10]


def test_a_crash_reported_first_by_its_peer_is_still_the_crash_retried(tmp_path) -> None:
    with pytest.warns(RankCrashRetried, match=r"(?s)rank 0 of 2 died of signal 6 \(attempt 1\).*_abort_rank_0_once"):
        assert run_ranks(_abort_rank_0_once_while_rank_1_waits, 2, str(tmp_path / "crashed"), timeout_s=120) == [0, 10]


def test_a_rank_crashing_twice_fails_the_caller() -> None:
    with pytest.warns(RankCrashRetried), pytest.raises(RankFailed, match=r"died of signal 6 \(attempt 2\)"):
        run_ranks(_abort_rank_1_always, 2, timeout_s=120)
