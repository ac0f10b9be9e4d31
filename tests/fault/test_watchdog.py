"""The watchdog follows the loop's phase marks, between hand-overs too."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from gpufleet.config import FaultConfig
from gpufleet.core.phases import Phase, PhaseAnnouncer
from gpufleet.fault.watchdog import Watchdog

STEP = [Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]


def test_the_thread_sees_the_marks_not_handed_over_yet(tmp_path):
    dog = Watchdog(FaultConfig(), tmp_path)
    view = SimpleNamespace(step=0)
    phases = PhaseAnnouncer([], view, [dog.on_phase_marks])
    for phase in STEP:
        phases.announce(phase)
    view.step = 1
    phases.announce(Phase.END)
    step_began = phases.marks.times[4]
    phases.announce(Phase.DATA)
    # Nothing was handed over: the heartbeat reads the marks under their lock.
    dog._view = view
    beat = dog.heartbeat()
    assert (beat["step"], beat["phase"], beat["activity"]) == (1, "data", "step")
    assert beat["activity_s"] == pytest.approx(time.perf_counter() - step_began, abs=0.5)
    assert abs(beat["phase_since"] - time.time()) < 5
    assert dog.limit("step") == FaultConfig().stall_min_s  # no step timed yet

    phases.announce(Phase.LOG)  # handed over: the finished step is timed
    with phases(Phase.EVAL):
        time.sleep(0.01)
    phases.announce(Phase.DATA)  # the evaluation ends, a step begins
    assert dog.heartbeat()["activity"] == "step"
    phases.hand_over()
    assert len(dog._durations["step"]) == 2  # a step, and the log line before the eval
    assert list(dog._durations["eval"]) == [pytest.approx(0.01, abs=0.5)]
    assert dog._durations["eval"][0] >= 0.01
    with phases(Phase.CHECKPOINT):
        assert dog.heartbeat()["activity"] == "checkpoint"
