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


class _ClockEvent:
    """Stands in for a CUDA timing event on a machine without CUDA: ``record`` reads a
    clock the test sets, ``elapsed_time`` answers in milliseconds, as CUDA's does."""

    clock = 0.0
    made = 0

    def __init__(self) -> None:
        _ClockEvent.made += 1
        self.at: float | None = None

    def record(self) -> None:
        self.at = _ClockEvent.clock

    def elapsed_time(self, end: _ClockEvent) -> float:
        return (end.at - self.at) * 1000.0


def test_the_stream_times_are_sampled_on_one_step_in_each_log_interval():
    """Events are recorded on one step of every ``every`` (from the end of a step s with
    s % every == 2 to the end of the next: not the FLOP-counted step 2, never spanning a
    log line); a log interval reads its sampled step, and one still being sampled waits."""
    from types import SimpleNamespace

    from gpufleet.monitor.phases import StreamSample

    sample, view = StreamSample(every=4, event=_ClockEvent), SimpleNamespace(step=0)
    recorded = []
    real = sample._record
    sample._record = lambda bucket: (recorded.append(view.step), real(bucket))
    # Step s: data s ms, forward 2, backward 3, optimizer 4, other 1 (a log line after
    # every fourth step); on the stream the same, as these events see it.
    taken = []
    for s in range(1, 13):
        for phase, ms in ((Phase.DATA, s), (Phase.FORWARD, 2), (Phase.BACKWARD, 3),
                          (Phase.OPTIMIZER, 4)):
            sample.on_phase(view, phase)
            _ClockEvent.clock += ms / 1000
        view.step = s
        sample.on_phase(view, Phase.END)
        _ClockEvent.clock += 0.001
        if s % 4 == 0:
            sample.on_phase(view, Phase.LOG)
            taken.append(sample.take())
    # Sampled: steps 3, 7 and 11 (after the ends of steps 2, 6 and 10), six events each.
    assert sorted(set(recorded)) == [2, 3, 6, 7, 10, 11] and len(recorded) == 18
    assert _ClockEvent.made == 6  # the events of a sampled step are reused by the next
    for got, s in zip(taken, (3, 7, 11), strict=True):
        assert dict(zip(PHASES, got)) == pytest.approx(
            {"data": s / 1000, "forward": 0.002, "backward": 0.003, "optimizer": 0.004,
             "other": 0.001})
    # A step being sampled when the interval is read is left for the next read.
    view.step = 14
    sample.on_phase(view, Phase.END)  # 14 % 4 == 2: step 15 is sampled
    sample.on_phase(view, Phase.DATA)
    assert sample.take() is None
    _ClockEvent.clock += 0.005
    view.step = 15
    sample.on_phase(view, Phase.END)
    assert sample.take()[0] == pytest.approx(0.005)


def test_short_log_intervals_are_sampled_too():
    from types import SimpleNamespace

    from gpufleet.monitor.phases import StreamSample

    for every, sampled in ((1, [1, 2, 3, 4, 5]), (2, [1, 3, 5]), (3, [2, 5])):
        sample, view, opened = StreamSample(every, event=_ClockEvent), SimpleNamespace(), []
        for s in range(1, 6):
            view.step = s
            sample.on_phase(view, Phase.END)
            if sample._on:
                opened.append(s)
        assert opened == sampled, every


def test_only_cuda_runs_sample_the_stream():
    assert PhaseTimer(torch.device("cpu")).stream is None
    assert PhaseTimer(torch.device("cpu")).device_times() is None


def test_a_restart_after_recovery_gives_the_gap_to_no_phase():
    """In-process recovery starts the steps again: the time from the failed step's last
    mark to the next step is no phase's, and a stream sample under way is dropped."""
    from types import SimpleNamespace

    from gpufleet.monitor.phases import StreamSample

    timer = PhaseTimer(torch.device("cpu"))
    timer.stream = StreamSample(every=4, event=_ClockEvent)
    view = SimpleNamespace(step=2)
    timer.stream.on_phase(view, Phase.END)  # 2 % 4 == 2: step 3 is being sampled
    timer.stream.on_phase(view, Phase.DATA)
    timer.on_phase_marks(None, marks_of([(Phase.DATA, 10.0), (Phase.FORWARD, 10.001),
                                         (Phase.BACKWARD, 10.003)]))  # the peer is lost
    timer.restart()
    assert timer.stream.take() is None and not timer.stream._on
    assert len(timer.stream._pool) == 2  # the dropped step's events, reused later
    timer.on_phase_marks(None, marks_of([(Phase.DATA, 40.0), (Phase.FORWARD, 40.001),
                                         (Phase.BACKWARD, 40.002),
                                         (Phase.OPTIMIZER, 40.004), (Phase.END, 40.005),
                                         (Phase.LOG, 40.006)]))
    host, steps = timer.take()
    assert steps == 1
    assert dict(zip(PHASES, host)) == pytest.approx(
        {"data": 0.001, "forward": 0.001, "backward": 0.002, "optimizer": 0.001,
         "other": 0.001})  # not the 30 s of recovery in backward
