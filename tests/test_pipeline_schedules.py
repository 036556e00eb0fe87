"""Pipeline schedules as data: built, checked for deadlocks, printed, simulated; one process, no torch.distributed."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections import Counter

import pytest

import dpar
from dpar.compiler.pipeline_parallel.schedules import (
    SCHEDULES, PipelineBubbleWarning, bubble_formula, build_schedule, check_deadlock_free, min_micro_batches,
    warn_if_bubble_large,
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


def assert_well_formed(schedule: PipelineSchedule, name: str, p: int, m: int, v: int) -> None:
    """Deadlock-free; one F and one B (or I and W) per stage and micro-batch; every send received once."""
    check_deadlock_free(schedule)
    assert schedule.num_stages == p * v
    compute = Counter((a.op, a.stage, a.micro_batch) for program in schedule.actions for a in program
                      if a.op.is_compute)
    backward = (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if name in ("zb_h1", "zbv") else (Op.BACKWARD,)
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
    crossings = sum(schedule.stage_rank(s) != schedule.stage_rank(s + 1) for s in range(p * v - 1))
    assert sum(sends.values()) == 2 * crossings * m  # two messages per boundary between ranks and micro-batch


def test_every_schedule_has_one_forward_and_backward_per_stage_and_micro_batch_and_matched_sends():
    built = 0
    for name, p, m, v in every_schedule():
        assert_well_formed(build(name, p, m, v), name, p, m, v)
        built += 1
    assert built == 5 * 16 * 3 + 2 * (16 + 8 + 5 + 4 + 2)


ZBV_RANKS, ZBV_MICRO_BATCHES = range(1, 9), range(1, 25)


def test_zbv_places_stages_in_a_v_and_is_well_formed_for_every_p_and_m():
    for p in ZBV_RANKS:
        for m in ZBV_MICRO_BATCHES:
            schedule = build_schedule("zbv", num_ranks=p, micro_batches=m)
            assert schedule.placement == (*range(p), *reversed(range(p)))
            assert all(schedule.stages_of(r) == (r, 2 * p - 1 - r) for r in range(p))
            assert_well_formed(schedule, "zbv", p, m, 2)
            # the turn of the V (stages p - 1 and p, both on rank p - 1) is the one boundary with no message
            assert not any(a.op in (Op.SEND_ACTIVATION, Op.SEND_GRADIENT) and a.stage in (p - 1, p)
                           and schedule.stage_rank(a.stage + (1 if a.op is Op.SEND_ACTIVATION else -1)) == p - 1
                           for a in schedule.actions[p - 1])


def test_zbv_printout_for_2_ranks_and_4_micro_batches_is_pinned():
    assert str(build_schedule("zbv", num_ranks=2, micro_batches=4)) == (
        "zbv: 2 ranks, 4 stages, 4 micro-batches\n"
        "rank 0: F0.0 SA0.0 F0.1 SA0.1 F0.2 SA0.2 RA3.0 F3.0 I3.0 SG3.0 W3.0 RA3.1 F3.1 I3.1 SG3.1 W3.1 F0.3 SA0.3 "
        "RG0.0 I0.0 W0.0 RA3.2 F3.2 I3.2 SG3.2 W3.2 RG0.1 I0.1 W0.1 RA3.3 F3.3 I3.3 SG3.3 W3.3 RG0.2 I0.2 W0.2 "
        "RG0.3 I0.3 W0.3\n"
        "rank 1: RA1.0 F1.0 F2.0 SA2.0 RA1.1 F1.1 F2.1 SA2.1 RG2.0 I2.0 W2.0 RA1.2 F1.2 I1.0 SG1.0 W1.0 F2.2 SA2.2 "
        "RG2.1 I2.1 W2.1 RA1.3 F1.3 I1.1 SG1.1 W1.1 F2.3 SA2.3 RG2.2 I2.2 W2.2 I1.2 SG1.2 RG2.3 I2.3 I1.3 SG1.3 W1.2 "
        "W2.3 W1.3"
    )


def test_checker_names_a_zbv_order_that_runs_the_turn_of_the_v_too_early():
    good = build_schedule("zbv", num_ranks=2, micro_batches=4)
    rank1 = list(good.actions[1])
    rank1.insert(0, rank1.pop(rank1.index(Action(Op.FORWARD, 2, 0))))  # stage 2 before stage 1, on the same rank
    with pytest.raises(dpar.ScheduleError, match=r"rank 1, action 0 \(F2.0\) needs F1.0 earlier on the same rank"):
        check_deadlock_free(edited(good, 1, rank1))


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


def test_zbv_bubble_matches_its_formula_and_is_half_of_zb_h1s():
    for p in ZBV_RANKS:
        for m in ZBV_MICRO_BATCHES:
            timeline = simulate(build_schedule("zbv", num_ranks=p, micro_batches=m), EQUAL)  # one unit per chunk
            idle = max(p - 1, 4 * p - 2 - 2 * m)  # [Note: the ZBV bubble]
            assert timeline.span == 6 * m + idle, (p, m)
            assert timeline.bubble == pytest.approx([idle / (6 * m + idle)] * p, abs=1e-12)
            assert bubble_formula("zbv", p, m) == pytest.approx(idle / (6 * m + idle))
            if 2 * m >= 3 * p - 1:  # each rank idle p - 1 chunk units: half of ZB-H1's p - 1 stage units
                zb_h1 = simulate(build("zb_h1", p, m), Costs(forward=2, backward_input=2, backward_weight=2))
                assert (timeline.span - 6 * m) * 2 == zb_h1.span - 6 * m == 2 * (p - 1)


def test_zbv_holds_1f1bs_peak_on_every_rank():
    for p in ZBV_RANKS:
        for m in ZBV_MICRO_BATCHES:
            timeline = simulate(build_schedule("zbv", num_ranks=p, micro_batches=m))
            # chunks held from F to W: at most 2p (p micro-batches of the rank's layers: 1F1B's rank 0), reached on
            # every rank from m = 2p - 1 on, the phases' own count (below it rank r holds m + 1 + r at most)
            peaks = [timeline.peak_in_flight_of_rank(r) for r in range(p)]
            assert peaks == [min(2 * p, 2 * m, m + 1 + r) for r in range(p)], (p, m)
    # per stage, 2p - s, as 1F1B's p - r over twice the stages: rank r's two stages hold 2p - r and r + 1 at their peaks
    assert simulate(build_schedule("zbv", num_ranks=4, micro_batches=8)).peak_in_flight == (8, 7, 6, 5, 4, 3, 2, 1)


def test_every_schedule_names_the_fewest_micro_batches_it_runs():
    for name in SCHEDULES:
        for p in RANKS:
            v = 2 if name == "interleaved_1f1b" else None
            fewest = min_micro_batches(name, p)
            assert fewest == (p if name == "interleaved_1f1b" else 1)
            build_schedule(name, num_ranks=p, micro_batches=fewest, virtual_stages=v)  # builds and replays
            if fewest > 1:
                with pytest.raises(dpar.TooFewMicroBatchesError,
                                   match=rf"{name} needs at least {p} micro-batches on {p} ranks .* got {fewest - 1}; "
                                         rf"use micro_batches={p}"):
                    build_schedule(name, num_ranks=p, micro_batches=fewest - 1, virtual_stages=v)


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
    with pytest.warns(PipelineBubbleWarning, match=r"'zbv' with 4 ranks x 2 stages in a V and 8 micro-batches .* "
                                                   r"idle 5\.9% .* 3\.0%"):
        warn_if_bubble_large("zbv", 4, 8)
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
    with pytest.raises(dpar.OptionsError, match=r"zbv places exactly 2 stages on each rank \(a V\), got virtual_stages=3"):
        build("zbv", 2, 4, 3)
    with pytest.raises(dpar.OptionsError, match=r"did you mean 'zbv'"):
        build("ZB-V", 2, 4)


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
