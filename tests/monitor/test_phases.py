"""The phase timer reads the loop's marks in batches, as it reads phases one by one."""

from __future__ import annotations

import pytest
import torch

from gpufleet.core.phases import Phase
from gpufleet.monitor.phases import PHASES, PhaseTimer

from .marks import marks_of


def test_the_phase_times_come_from_the_marks_between_log_lines():
    timer = PhaseTimer(torch.device("cpu"))
    assert timer.phase_marks  # off CUDA: the marks' clock reads are all it needs
    timer.on_fit_start(None)
    # Two steps: data 1 ms, forward 2, backward 3, optimizer 4, then 0.5 of other.
    t, timed = 100.0, []
    for _ in range(2):
        for phase, seconds in ((Phase.DATA, 0.001), (Phase.FORWARD, 0.002),
                               (Phase.BACKWARD, 0.003), (Phase.OPTIMIZER, 0.004),
                               (Phase.END, 0.0005)):
            timed.append((phase, t))
            t += seconds
    timed += [(Phase.EVAL, t), (Phase.DATA, t + 0.25)]  # evaluation is kept apart
    timer.on_phase_marks(None, marks_of(timed[:7]))  # a batch may end inside a step
    timer.on_phase_marks(None, marks_of(timed[7:]))
    host, steps = timer.take()
    assert steps == 2
    assert dict(zip(PHASES, host)) == pytest.approx(
        {"data": 0.001, "forward": 0.002, "backward": 0.003, "optimizer": 0.004,
         "other": 0.0005})  # from each step's end to what follows it
    assert timer.outside["eval"] == pytest.approx([0.25, 1])
