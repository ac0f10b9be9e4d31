"""Where each step's time goes, on every rank: data wait, forward, backward (with the
gradient all-reduce), optimizer, other.

The loop announces each phase change (:meth:`PhaseTimer.on_phase`); the timer adds the
host time since the previous change to the phase that just ended. That is a clock read
and a list add per change. On CUDA it also records an event on the current stream at
each change; the events are read at the log interval, when the loop synchronises anyway,
so the GPU-side times cost no sync per step.

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
from gpufleet.core.phases import Phase

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
        now = time.perf_counter()
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
        if self.cuda:
            self._record(-1 if bucket is None else bucket)

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
