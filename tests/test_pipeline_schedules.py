"""Pipeline schedules as data: built, checked for deadlocks, printed, simulated; one process, no torch.distributed."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections import Counter

import pytest

import dpar
from dpar.compiler.pipeline_parallel.schedules import (
    PipelineBubbleWarning, bubble_formula, build_schedule, check_deadlock_free, warn_if_bubble_large,
)
from dpar.core.pipeline_program import Action, Op, PipelineSchedule
from dpar.compiler.pipeline_parallel.simulate import Costs, simulate
from dpar.inspect.trace import write_schedule_trace

RANKS = (1, 2, 3, 4, 8)
EQUAL = Costs(forward=1, backward=1, backward_input=1, backward_weight=1)


def every_schedule():
    """Every (name, p, m, v) the tests cover: 4 schedules, p in RANKS, m in 1..16."""
    for p in RANKS:
        for m in range(1, 17):
            for name in ("gpipe", "1f1b", "zb_h1"):
                yield name, p, m, 1
            if m % p == 0:
                for v in (2, 3):
                    yield "interleaved_1f1b", p, m, v


def build(name: str, p: int, m: int, v: int = 1) -> PipelineSchedule:
    return build_schedule(name, num_ranks=p, micro_batches=m, virtual_stages=v)


def test_every_schedule_has_one_forward_and_backward_per_stage_and_micro_batch_and_matched_sends():
    built = 0
    for name, p, m, v in every_schedule():
        schedule = build(name, p, m, v)
        check_deadlock_free(schedule)
        assert schedule.num_stages == p * v
        compute = Counter((a.op, a.stage, a.micro_batch) for program in schedule.actions for a in program
                          if a.op.is_compute)
        backward = (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if name == "zb_h1" else (Op.BACKWARD,)
        expected = Counter((op, s, i) for s in range(p * v) for i in range(m) for op in (Op.FORWARD, *backward))
        assert compute == expected, (name, p, m, v)
        sends = Counter((a.op, a.stage, a.micro_batch, r) for r, program in enumerate(schedule.actions)
                        for a in program if a.op in (Op.SEND_ACTIVATION, Op.SEND_GRADIENT))
        recvs = Counter()
        for r, program in enumerate(schedule.actions):
            for a in program:
                if a.op is Op.RECV_ACTIVATION:
                    recvs[Op.SEND_ACTIVATION, a.stage - 1, a.micro_batch, schedule.stage_rank(a.stage - 1)] += 1
                elif a.op is Op.RECV_GRADIENT:
                    recvs[Op.SEND_GRADIENT, a.stage + 1, a.micro_batch, schedule.stage_rank(a.stage + 1)] += 1
        assert sends == recvs and set(sends.values()) <= {1}, (name, p, m, v)
        # two messages per stage boundary and micro-batch; with one rank there are none
        assert sum(sends.values()) == (2 * (p * v - 1) * m if p > 1 else 0)
        built += 1
    assert built == 5 * 16 * 3 + 2 * (16 + 8 + 5 + 4 + 2)


def test_1f1b_printout_for_2_ranks_and_4_micro_batches_is_pinned():
    assert str(build("1f1b", 2, 4)) == (
        "1f1b: 2 ranks, 2 stages, 4 micro-batches\n"
        "rank 0: F0.0 SA0.0 F0.1 SA0.1 RG0.0 B0.0 F0.2 SA0.2 RG0.1 B0.1 F0.3 SA0.3 RG0.2 B0.2 RG0.3 B0.3\n"
        "rank 1: RA1.0 F1.0 B1.0 SG1.0 RA1.1 F1.1 B1.1 SG1.1 RA1.2 F1.2 B1.2 SG1.2 RA1.3 F1.3 B1.3 SG1.3"
    )


def edited(schedule: PipelineSchedule, rank: int, program: list[Action]) -> PipelineSchedule:
    actions = list(schedule.actions)
    actions[rank] = tuple(program)
    return dataclasses.replace(schedule, actions=tuple(actions))


def test_checker_names_both_ranks_when_each_receives_before_its_peer_sends():
    good = build("1f1b", 2, 4)
    rank0 = list(good.actions[0])
    rank0.insert(0, rank0.pop(rank0.index(Action(Op.RECV_GRADIENT, 0, 0))))  # rank 0 waits for a gradient first
    with pytest.raises(dpar.ScheduleError) as e:
        check_deadlock_free(edited(good, 0, rank0))
    assert "rank 0, action 0 (RG0.0) waits forever for SG1.0 from rank 1" in str(e.value)
    assert "rank 1, action 0 (RA1.0) waits forever for SA0.0 from rank 0" in str(e.value)


def test_checker_names_a_receive_whose_send_is_missing():
    good = build("gpipe", 3, 2)
    with pytest.raises(dpar.ScheduleError, match=r"deadlocks: rank 2, action 2 \(RA2.1\) waits forever for "
                                                 r"SA1.1 from rank 1, which rank 1 never issues; rank 0"):
        check_deadlock_free(edited(good, 1, [a for a in good.actions[1] if a != Action(Op.SEND_ACTIVATION, 1, 1)]))


def test_checker_names_an_action_run_before_what_it_needs_on_its_own_rank():
    good = build("zb_h1", 2, 3)
    rank1 = list(good.actions[1])
    w, i = rank1.index(Action(Op.BACKWARD_WEIGHT, 1, 0)), rank1.index(Action(Op.BACKWARD_INPUT, 1, 0))
    rank1.insert(i, rank1.pop(w))  # W before its I
    with pytest.raises(dpar.ScheduleError, match=r"rank 1, action 2 \(W1.0\) needs I1.0 earlier on the same rank"):
        check_deadlock_free(edited(good, 1, rank1))


def test_checker_names_a_missing_backward_and_a_duplicate_send():
    good = build("1f1b", 2, 2)
    with pytest.raises(dpar.ScheduleError, match=r"rank 1: stage 1, micro-batch 1 has compute actions \['F'\]"):
        check_deadlock_free(edited(good, 1, [a for a in good.actions[1] if a != Action(Op.BACKWARD, 1, 1)]))
    with pytest.raises(dpar.ScheduleError, match=r"rank 0, action 3 \(SA0.0\) sends a second time"):
        check_deadlock_free(edited(good, 0, [*good.actions[0][:3], Action(Op.SEND_ACTIVATION, 0, 0),
                                             *good.actions[0][3:]]))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1_on_every_rank(name):
    for p in RANKS:
        for m in range(1, 17):
            timeline = simulate(build(name, p, m), EQUAL)
            assert timeline.span == 2 * (m + p - 1)
            assert timeline.bubble == pytest.approx([(p - 1) / (m + p - 1)] * p, abs=1e-12)


def test_interleaved_bubble_is_megatrons_p_minus_1_over_v_m_plus_p_minus_1():
    for name, p, m, v in every_schedule():
        if name == "interleaved_1f1b":
            timeline = simulate(build(name, p, m, v), EQUAL)  # F and B: one chunk, 1/v of a rank's layers
            assert timeline.span == 2 * (v * m + p - 1)
            assert timeline.bubble == pytest.approx([(p - 1) / (v * m + p - 1)] * p, abs=1e-12)
    assert bubble_formula("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)


def test_zb_h1_bubble_matches_its_derivation_and_is_a_third_of_1f1bs():
    for p in RANKS:
        for m in range(1, 17):
            timeline = simulate(build("zb_h1", p, m), EQUAL)
            span = max(3 * m + p - 1, 2 * m + 2 * p - 1)  # [Note: the ZB-H1 bubble]
            assert timeline.span == span
            assert timeline.bubble == pytest.approx([(span - 3 * m) / span] * p, abs=1e-12)
            assert bubble_formula("zb_h1", p, m) == pytest.approx((span - 3 * m) / span)
            if m >= p:  # the paper's setting: idle time per rank is a third of 1F1B's with B = I + W
                one_f_one_b = simulate(build("1f1b", p, m), Costs(forward=1, backward=2))
                assert (timeline.span - 3 * m) * 3 == one_f_one_b.span - 3 * m == 3 * (p - 1)


def test_send_latency_delays_each_hop_of_the_first_micro_batch():
    timeline = simulate(build("1f1b", 2, 1), Costs(forward=1, backward=1, latency=0.25))
    assert timeline.span == 4.5  # F, L, F, B, L, B
    assert timeline.bubble == pytest.approx([2.5 / 4.5] * 2)


def test_peak_in_flight_micro_batches_per_stage():
    for p in RANKS:
        for m in range(1, 17):
            one_f_one_b = simulate(build("1f1b", p, m)).peak_in_flight
            assert one_f_one_b == tuple(min(p - r, m) for r in range(p))
            assert simulate(build("gpipe", p, m)).peak_in_flight == (m,) * p
            zb = simulate(build("zb_h1", p, m)).peak_in_flight
            assert zb == (min(p, m),) * p  # every rank holds 1F1B's peak (rank 0's) until its W
            assert max(zb) == max(one_f_one_b)
    interleaved = simulate(build("interleaved_1f1b", 4, 8, 2))
    assert [interleaved.peak_in_flight_of_rank(r) for r in range(4)] == [11, 9, 7, 5]  # chunks of half a stage


def test_bubble_warning_names_the_percentage_and_the_fix_below_4_micro_batches_per_stage():
    with pytest.warns(PipelineBubbleWarning, match=r"idle 27\.3% .* micro_batches >= 16 .* 15\.8%"):
        warn_if_bubble_large("1f1b", 4, 8)
    with pytest.warns(PipelineBubbleWarning, match=r"idle 11\.1% .* 5\.9%"):
        warn_if_bubble_large("zb_h1", 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_bubble_large("1f1b", 4, 16)
        warn_if_bubble_large("gpipe", 1, 1)


def test_bad_schedule_arguments_name_the_fix():
    with pytest.raises(dpar.OptionsError, match=r"unknown pipeline schedule '1fb1' \(did you mean '1f1b'\?\)"):
        build("1fb1", 2, 4)
    with pytest.raises(dpar.OptionsError, match=r"did you mean 'zb_h1'"):
        build("ZBH1", 2, 4)
    with pytest.raises(dpar.OptionsError, match=r"multiple of 4, got 6; use micro_batches=8 or 4"):
        build("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(dpar.OptionsError, match=r"virtual_stages >= 2, got 1; pass virtual_stages=2"):
        build("interleaved_1f1b", 4, 8, 1)
    with pytest.raises(dpar.OptionsError, match=r"virtual_stages=2 applies only to schedule='interleaved_1f1b'"):
        build("1f1b", 4, 8, 2)
    with pytest.raises(dpar.OptionsError, match=r"micro_batches must be an integer >= 1, got 0"):
        build("gpipe", 2, 0)


def test_timeline_saves_as_a_perfetto_trace_with_a_process_per_rank(tmp_path):
    timeline = simulate(build("zb_h1", 4, 8), EQUAL)
    doc = json.loads(write_schedule_trace(timeline, tmp_path / "zb_h1.json").read_text())
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert names == [f"rank {r}" for r in range(4)]
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == sum(len(program) for program in timeline.schedule.actions)
    compute = [e for e in slices if e["cat"] == "compute"]
    assert len(compute) == 4 * 8 * 3
    assert max(e["ts"] + e["dur"] for e in compute) == pytest.approx(27 * 1e6)  # span 3m + p - 1
    assert doc["otherData"]["bubble"] == pytest.approx([3 / 27] * 4)
