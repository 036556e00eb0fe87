"""Planning work in forked processes beside the caller's (api/side_processes.py): values, errors, warnings, a child
that dies or deadlocks, at most `processes` jobs at once, and the same values in one process."""

from __future__ import annotations

import os
import signal
import time
import warnings

import pytest

import dpar.side_processes as side_processes
from dpar.side_processes import SideProcesses, forking_allowed

pytestmark = pytest.mark.skipif(not forking_allowed(), reason="forks only on Linux, with two cores or more")


@pytest.fixture
def forks_run_autograd() -> None:
    """Skips where torch refuses autograd in this process's forks (torch 2.14.1's CUDA build once a backward ran here):
    every job then runs in this process, and a test of what children do has no child to test."""
    with SideProcesses(2) as side, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if side.result(side.submit("forks", os.getpid)) == os.getpid():
            pytest.skip("torch refuses autograd in this process's forks: the jobs run in it")


class Refused(ValueError):
    pass


def _refuse() -> None:
    raise Refused("the count refused this copy")


def _warn_and_answer() -> tuple[int, int]:
    warnings.warn("a copy's forward warned", UserWarning)
    return os.getpid(), 42


@pytest.mark.usefixtures("forks_run_autograd")
def test_a_job_runs_in_a_child_and_its_value_warnings_and_error_come_back() -> None:
    with SideProcesses(2) as side:
        answered, refused = side.submit("answer", _warn_and_answer), side.submit("refuse", _refuse)
        with pytest.warns(UserWarning, match="a copy's forward warned"):
            pid, value = side.result(answered)
        assert value == 42 and pid != os.getpid()
        with pytest.raises(Refused, match="refused this copy") as raised:
            side.result(refused)
        assert "_refuse" in str(raised.value.__cause__)  # the child's traceback
        assert {job.name for job in side.finished} == {"answer", "refuse"}
        assert all(job.seconds > 0 for job in side.finished)
        assert side.result(side.submit("yields", lambda: os.nice(0), nice=5)) == min(os.nice(0) + 5, 19)


def test_one_process_gives_the_same_values_in_the_callers_process_when_asked() -> None:
    ran = []
    with SideProcesses(1) as side:
        job = side.submit("here", lambda: ran.append(os.getpid()) or len(ran))
        assert not side.forks and ran == []  # nothing runs before its result is asked for
        assert side.result(job) == 1 and ran == [os.getpid()]
        with pytest.raises(Refused):
            side.result(side.submit("refuse", _refuse))


@pytest.mark.usefixtures("forks_run_autograd")
def test_a_child_killed_by_a_signal_is_an_error_naming_it() -> None:
    with SideProcesses(2) as side:
        job = side.submit("killed", lambda: os.kill(os.getpid(), signal.SIGKILL))
        with pytest.raises(RuntimeError, match=r"killed: the forked process computing it ended without a result "
                                               r"\(killed by signal 9"):
            side.result(job)


@pytest.mark.usefixtures("forks_run_autograd")
def test_a_child_whose_cpu_time_stands_still_is_stopped_and_its_job_run_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(side_processes, "STALLED_S", 1.0)
    parent = os.getpid()

    def deadlocks_in_a_child() -> int:
        if os.getpid() != parent:
            time.sleep(600)  # no CPU time: what a deadlock looks like from outside
        return os.getpid()

    start = time.monotonic()
    with SideProcesses(2) as side:
        job = side.submit("stalls", deadlocks_in_a_child)
        with pytest.warns(RuntimeWarning, match="stalls: the forked process computing it made no progress"):
            assert side.result(job) == parent
    assert time.monotonic() - start < 30


def test_jobs_run_here_once_torch_refuses_a_child_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.14.1's CUDA build refuses autograd in a fork of a process that ran a backward; the jobs then run in
    the caller's process, with one warning."""
    parent = os.getpid()
    refusal = "Unable to handle autograd's threading in combination with fork-based multiprocessing"
    monkeypatch.setattr(side_processes, "_autograd_refusal", lambda: refusal if os.getpid() != parent else None)
    with SideProcesses(2) as side:
        jobs = [side.submit(f"copy {i}", lambda i=i: (os.getpid(), i)) for i in range(3)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [side.result(job) for job in jobs] == [(parent, i) for i in range(3)]
        assert not side.forks
        assert side.result(side.submit("later", os.getpid)) == parent
    told = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(told) == 1 and "copy 0: torch refuses autograd in a process forked from this one" in told[0], told
    assert refusal in told[0] and "`dpar plan`" in told[0]


@pytest.mark.usefixtures("forks_run_autograd")
def test_at_most_processes_jobs_run_at_once_and_a_cancelled_one_never_runs(tmp_path) -> None:
    def spell(i: int) -> tuple[float, float]:
        start = time.monotonic()
        while time.monotonic() - start < 0.4:  # busy: its CPU time moves
            pass
        (tmp_path / f"ran{i}").touch()
        return start, time.monotonic()

    with SideProcesses(2) as side:
        jobs = [side.submit(f"spell {i}", lambda i=i: spell(i)) for i in range(4)]
        side.cancel(jobs[3])
        spans = [side.result(job) for job in jobs[:3]]
    assert not (tmp_path / "ran3").exists()
    for start, _ in spans:
        assert sum(s <= start < e for s, e in spans) <= 2  # at any job's start, at most two run
    assert spans[2][0] >= min(spans[0][1], spans[1][1]) - 0.05  # the third waited for a core


@pytest.mark.usefixtures("forks_run_autograd")
def test_a_plan_is_the_same_planned_in_one_process_or_beside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dpar.plan(on_graphs=True)`` on the tests' GPT over 8 H100s (ddp+tp, 4 blocks: counted whole; the pipeline
    search and the count forked), against the same call with one core (everything in this process): the same plan,
    its figures to the bit; only the forked call lists the jobs it ran beside."""
    import dpar
    from planner_models import gpt

    model, inputs = gpt(n_layer=4, n_embd=256, n_head=4, block=64, vocab=512, batch=8)
    beside = dpar.plan(model, inputs, mesh_shape=(2, 4), on_graphs=True)
    monkeypatch.setattr(side_processes, "cores", lambda: 1)
    here = dpar.plan(model, inputs, mesh_shape=(2, 4), on_graphs=True)
    assert beside == here and beside.cost == here.cost and beside.counted_on_graphs
    assert here.beside == () and {name for name, _ in beside.beside} == {"the pipeline search", "the count on the whole model"}
