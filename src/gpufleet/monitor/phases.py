"""Where each step's time goes, on every rank: data wait, forward, backward (with the
gradient all-reduce), optimizer, other.

The loop marks each phase change (:mod:`gpufleet.core.phases`: a clock read into a
reused buffer); the timer reads the marks in batches, at the log interval at the latest,
and adds the host time between marks to the phase that ran. On CUDA it instead hears
each change as it happens (:meth:`PhaseTimer.on_phase`) and also records an event on
the current stream there; the events are read at the log interval, when the loop
synchronises anyway, so the GPU-side times cost no sync per step.

Evaluation and checkpointing are not part of a step: their time is kept apart
(:attr:`PhaseTimer.outside`), for the rule that finds a run spending its time outside
training steps.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from gpufleet.core.callbacks import Callback
from gpufleet.core.phases import Phase, PhaseMarks

PHASES = ("data", "forward", "backward", "optimizer", "other")
# What the loop's phase names count as.
_BUCKET = {Phase.DATA: 0, Phase.FORWARD: 1, Phase.BACKWARD: 2, Phase.OPTIMIZER: 3,
           Phase.END: 4, Phase.LOG: 4}


class PhaseTimer(Callback):
    """Accumulates per-phase host (and CUDA) time over a log interval.

    Args:
        device: the rank's device; CUDA events are used on a CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # Off CUDA the marks' clock reads are all it needs; on CUDA each change also
        # records an event on the stream, as it happens.
        self.phase_marks = not self.cuda
        self._host = [0.0] * len(PHASES)
        self._current: int | None = None
        self._since = 0.0
        self._steps = 0
        self._events: list[tuple[int, Any]] = []  # (bucket that starts, event) on CUDA
        self._pool: list[Any] = []
        self._interval_steps = 1
        #: host seconds and counts of what ran between steps: "eval", "checkpoint"
        self.outside: dict[str, list[float]] = {}
        self._outside_kind: str | None = None

    def on_fit_start(self, trainer: Any) -> None:
        self._current, self._since = None, time.perf_counter()

    def on_phase(self, trainer: Any, phase: str) -> None:
        self._add(phase, time.perf_counter())
        if self.cuda:
            self._record(-1 if self._current is None else self._current)

    def on_phase_marks(self, trainer: Any, marks: PhaseMarks) -> None:
        # _add for each mark, inlined: this runs for every mark of the log interval.
        host, buckets, end = self._host, _BUCKET, Phase.END
        current, since, kind = self._current, self._since, self._outside_kind
        for phase, now in marks:
            if current is not None:
                host[current] += now - since
            elif kind is not None:
                kept = self.outside.setdefault(kind, [0.0, 0])
                kept[0] += now - since
                kept[1] += 1
            current, since = buckets.get(phase), now
            kind = str(phase) if current is None else None
            if phase == end:
                self._steps += 1
        self._current, self._since, self._outside_kind = current, since, kind

    def _add(self, phase: str, now: float) -> None:
        """Phase ``phase`` began at ``now`` (perf_counter seconds)."""
        if self._current is not None:
            self._host[self._current] += now - self._since
        elif self._outside_kind is not None:
            kept = self.outside.setdefault(self._outside_kind, [0.0, 0])
            kept[0] += now - self._since
            kept[1] += 1
        bucket = _BUCKET.get(phase)  # None: eval / checkpoint, outside the step
        self._outside_kind = str(phase) if bucket is None else None
        if phase == Phase.END:
            self._steps += 1
        self._current, self._since = bucket, now

    def _record(self, bucket: int) -> None:
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record()
        self._events.append((bucket, event))

    def take(self) -> tuple[list[float], int]:
        """Mean host seconds per step of each phase since the last call, and the number
        of steps; resets the interval."""
        steps = max(1, self._steps)
        host = [t / steps for t in self._host]
        self._host = [0.0] * len(PHASES)
        self._steps = 0
        self._interval_steps = steps
        return host, steps

    def device_times(self) -> list[float] | None:
        """Mean CUDA-stream seconds per step of each phase over the interval just taken
        (None off CUDA). Call after the loop's log-interval sync: every event recorded
        before it has completed, so nothing waits here."""
        if not self.cuda:
            return None
        steps = self._interval_steps
        totals = [0.0] * len(PHASES)
        events = self._events
        for (bucket, start), (_, end) in itertools.pairwise(events):
            if bucket >= 0:
                totals[bucket] += start.elapsed_time(end) / 1000.0  # ms -> s
        # Keep the newest event: it opens the phase running now.
        self._pool.extend(e for _, e in events[:-1])
        self._events = events[-1:]
        return [t / steps for t in totals]
