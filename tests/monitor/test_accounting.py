"""Step accounting: the parts of each rank's step from recorded phase marks and waits,
the residual against the step clock, the findings' citations and the report's bars."""

from __future__ import annotations

import pytest
import torch

from gpufleet.core.phases import Phase
from gpufleet.monitor.accounting import (
    PARTS,
    TOLERANCE,
    describe,
    mean_accounting,
    rank_accounting,
    run_residual,
)
from gpufleet.monitor.diagnose import RunFacts, Summary, cite_accounting, diagnose
from gpufleet.monitor.findings import Finding
from gpufleet.monitor.phases import PHASES, PhaseTimer
from gpufleet.monitor.report import render_report
from gpufleet.monitor.report_svg import stacked_bars

from .marks import marks_of


def _phases(*rows):
    return [{"rank": r, **dict(zip(PHASES, row))} for r, row in enumerate(rows)]


def _clock(*walls, eval_s=0.0, ckpt=0.0):
    return [{"rank": r, "wall": w, "eval": eval_s, "checkpoint": ckpt}
            for r, w in enumerate(walls)]


def _timed(steps, t0=100.0):
    """Marks of ``steps`` steps: data 2 ms, forward 3, backward 10, optimizer 1, end 0.5
    ms (each step ends with END, then the 'other' time before the next DATA)."""
    marks, t = [], t0
    for _ in range(steps):
        for phase, length in ((Phase.DATA, 2e-3), (Phase.FORWARD, 3e-3),
                              (Phase.BACKWARD, 10e-3), (Phase.OPTIMIZER, 1e-3),
                              (Phase.END, 0.5e-3)):
            marks.append((phase, t))
            t += length
    return marks, t


def test_the_parts_of_recorded_marks_sum_to_the_step_clock_with_the_waits_split_off():
    # Two ranks' timers read the same recorded steps; rank 0 waited 6 ms in the
    # gradient all-reduce, rank 1 (the last to arrive) 2 ms: the transfer.
    marks, end = _timed(10)
    timer = PhaseTimer(torch.device("cpu"))
    timer.on_phase_marks(None, marks_of([*marks, (Phase.LOG, end)]))
    host, steps = timer.take()
    assert steps == 10
    wall = end - 100.0  # what a clock from the first mark to the log line read
    rows = rank_accounting(_phases(host, host),
                           [{"wait": 6e-3, "wait_fwd": 0.0}, {"wait": 2e-3, "wait_fwd": 0.0}],
                           _clock(wall / steps, wall / steps))
    r0, r1 = rows
    assert r0["backward"] == pytest.approx(4e-3) and r1["backward"] == pytest.approx(8e-3)
    assert r0["exposed_comm"] == r1["exposed_comm"] == pytest.approx(2e-3)
    assert r0["late_ranks"] == pytest.approx(4e-3) and r1["late_ranks"] == pytest.approx(0.0)
    assert r0["data"] == pytest.approx(2e-3) and r0["optimizer"] == pytest.approx(1e-3)
    assert r0["host"] is None  # not measured: it stays inside its phase
    for row in rows:
        assert sum(row[p] or 0.0 for p in PARTS) + row["residual"] == pytest.approx(row["step"])
        assert abs(row["residual_share"]) < 1e-9


def test_time_no_mark_covers_is_left_in_the_residual_not_hidden():
    # The step clock ran 20% longer than the marks cover (say a pause before the first
    # step): the residual says so, and the parts are not stretched to match.
    rows = rank_accounting(_phases((0.01, 0.02, 0.05, 0.01, 0.01)), None, _clock(0.125))
    (row,) = rows
    assert row["residual"] == pytest.approx(0.025)
    assert row["residual_share"] == pytest.approx(0.2)
    assert row["backward"] == pytest.approx(0.05) and not row["comm_measured"]
    assert abs(row["residual_share"]) > TOLERANCE


def test_a_wait_measured_longer_than_its_phase_shows_as_a_negative_residual():
    # 80 ms "inside the all-reduce" of a 50 ms backward: compute is not made negative;
    # the parts then exceed the clock by the 30 ms the measurements disagree on.
    (row,) = rank_accounting(_phases((0.0, 0.0, 0.05, 0.0, 0.0)),
                             [{"wait": 0.08, "wait_fwd": 0.0}], _clock(0.05))
    assert row["backward"] == 0.0
    assert row["residual"] == pytest.approx(-0.03)


def test_fsdp_forward_collectives_leave_forward_and_eval_time_is_its_own_part():
    rows = rank_accounting(_phases((0.0, 0.03, 0.04, 0.0, 0.0), (0.0, 0.03, 0.04, 0.0, 0.0)),
                           [{"wait": 0.01, "wait_fwd": 0.02}, {"wait": 0.005, "wait_fwd": 0.0}],
                           _clock(0.08, 0.08, eval_s=0.01))
    r0, r1 = rows
    assert r0["forward"] == pytest.approx(0.01) and r1["forward"] == pytest.approx(0.03)
    assert r0["exposed_comm"] == pytest.approx(0.005)  # rank 1 spent 5 ms in all
    assert r0["late_ranks"] == pytest.approx(0.025)
    assert r0["eval_checkpoint"] == pytest.approx(0.01)
    assert r0["residual"] == pytest.approx(0.0) and r1["residual"] == pytest.approx(0.0)


def test_outside_time_is_taken_per_interval():
    timer = PhaseTimer(torch.device("cpu"))
    timer.on_phase_marks(None, marks_of([(Phase.END, 0.0), (Phase.EVAL, 1.0),
                                         (Phase.DATA, 1.5)]))
    assert timer.take_outside() == {"eval": pytest.approx(0.5)}
    timer.on_phase_marks(None, marks_of([(Phase.CHECKPOINT, 2.0), (Phase.DATA, 2.25)]))
    assert timer.take_outside() == {"eval": 0.0, "checkpoint": pytest.approx(0.25)}


def test_means_over_intervals_and_the_run_residual_leave_the_first_interval_out():
    a = [{"rank": 0, "data": 0.1, "step": 0.2, "residual": 0.05, "residual_share": 0.25,
          "comm_measured": True, "host": None}]
    b = [{"rank": 0, "data": 0.1, "step": 0.2, "residual": 0.002, "residual_share": 0.01,
          "comm_measured": True, "host": None}]
    c = [{"rank": 0, "data": 0.1, "step": 0.2, "residual": -0.004, "residual_share": -0.02,
          "comm_measured": False, "host": None}]
    mean = mean_accounting([b, c], [10, 30])[0]
    assert mean["residual"] == pytest.approx(-0.0025) and mean["comm_measured"] is False
    recs = [{"step": 5, "rank_accounting": a}, {"step": 15, "rank_accounting": b},
            {"step": 45, "rank_accounting": c}]
    assert run_residual(recs) == (pytest.approx(-0.0125), pytest.approx(-0.02))
    assert run_residual([{"step": 5}]) is None


def test_an_input_bound_finding_cites_the_data_wait_of_the_measured_step():
    s = Summary(steps=100, step_s=0.197, rank_phases=_phases((0.177, 0.01, 0.006, 0.003,
                                                               0.001)))
    s.rank_accounting = rank_accounting(s.rank_phases, None, _clock(0.197))
    f = {f.rule: f for f in diagnose(s, RunFacts())}["input-bound"]
    assert "data wait 177.0 ms of the 197.0 ms measured step (90%)" in f.message
    assert f.measurements["accounting"]["data"] == pytest.approx(0.177)
    assert f.measurements["accounting"]["step"] == pytest.approx(0.197)


def test_a_straggler_cites_the_wait_of_the_rank_that_waits_for_it():
    acc = [{"rank": 0, "late_ranks": 0.015, "step": 0.03, "residual": 0.0},
           {"rank": 1, "late_ranks": 0.0, "step": 0.03, "residual": 0.0}]
    f = cite_accounting(Finding("straggler", "warn", "rank 1 is the straggler", "m.", "f",
                                measurements={"rank": 1}), acc)
    assert "on rank 0: waiting for late ranks 15.0 ms of the 30.0 ms measured step" \
        in f.message
    assert f.measurements["accounting"]["rank"] == 0
    assert describe({"other": 0.0, "step": 0.0}, "other").startswith("other 0.0 ms")


def test_the_report_draws_one_bar_per_rank_with_the_measured_step_and_residual(tmp_path):
    acc = rank_accounting(_phases((0.002, 0.003, 0.004, 0.001, 0.0005),
                                  (0.002, 0.003, 0.009, 0.001, 0.0005)),
                          [{"wait": 0.006, "wait_fwd": 0.0}, {"wait": 0.001, "wait_fwd": 0.0}],
                          _clock(0.0106, 0.0157))
    train = [{"kind": "train", "step": s, "loss": 1.0, "rank_accounting": acc}
             for s in (5, 10, 15)]
    html = render_report(tmp_path, train, [], [])
    assert "Where each rank" in html and "waiting for late ranks" in html
    assert html.count('class="measured"') == 2  # a tick per rank
    assert "measured 15.7 ms, residual +0.20 ms (+1.3%)" in html
    assert "Host overhead (Python between operators and launches) is not measured" in html
    bars = stacked_bars("t", [("a", {"x": 1.0})], ["x"], "ms", measured=[2.0],
                        notes=["n"])
    assert ">n</text>" in bars and 'x1="' in bars

