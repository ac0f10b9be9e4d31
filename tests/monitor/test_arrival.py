"""The all-reduce arrival timer: each backward's wait, from the marks in batches."""

from __future__ import annotations

import pytest

from gpufleet.core.phases import Phase
from gpufleet.monitor.arrival import ArrivalTimer

from .marks import marks_of


def test_the_wait_runs_from_the_last_bucket_to_the_end_of_its_backward():
    timer = ArrivalTimer()
    assert timer.phase_marks
    # Step 1: buckets ready at 1.0 and 1.2, backward ends at 1.5 (wait 0.3). Step 2: the
    # last bucket at 2.9; the marks are read before its backward ends.
    timer._ready.extend([1.0, 1.2, 2.9])
    timer.on_phase_marks(None, marks_of([(Phase.BACKWARD, 0.9), (Phase.OPTIMIZER, 1.5),
                                       (Phase.END, 1.6), (Phase.BACKWARD, 2.5)]))
    assert timer._ready == [2.9]  # kept for the backward still running
    timer.on_phase_marks(None, marks_of([(Phase.OPTIMIZER, 3.0), (Phase.END, 3.1),
                                       (Phase.OPTIMIZER, 3.2)]))  # a 2nd optimizer: no wait
    timer.measures = "ddp"
    wait = timer.take()[0]
    assert wait == pytest.approx((0.3 + 0.1) / 2)
    assert timer._ready == []
