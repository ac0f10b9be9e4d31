"""Where each step's time goes, on every rank: data wait, forward, backward (with the
gradient all-reduce), optimizer, other.

The loop marks each phase change (:mod:`gpufleet.core.phases`: a clock read into a
reused buffer); the timer reads the marks in batches, at the log interval at the latest,
and adds the host time between marks to the phase that ran. On CUDA the stream's time
per phase is sampled as well (:class:`StreamSample`): events recorded at the phase
changes of one step in each log interval, read at the log interval when the loop
synchronises anyway. The other steps record nothing, and no step waits for the GPU.

Evaluation and checkpointing are not part of a step: their time is kept apart
(:attr:`PhaseTimer.outside`), for the rule that finds a run spending its time outside
training steps.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from gpufleet.core.callbacks import Callback
from gpufleet.core.phases import Phase, PhaseMarks

PHASES = ("data", "forward", "backward", "optimizer", "other")
# What the loop's phase names count as.
_BUCKET = {Phase.DATA: 0, Phase.FORWARD: 1, Phase.BACKWARD: 2, Phase.OPTIMIZER: 3,
           Phase.END: 4, Phase.LOG: 4}
_SAMPLE_ENDS = -2  # StreamSample: the event that ends a sampled step


class PhaseTimer(Callback):
    """Accumulates per-phase host time over a log interval, from the loop's marks.

    Args:
        device: the rank's device; on CUDA, :attr:`stream` samples the stream's times.
        every: the log interval in steps (one step in each is sampled on CUDA).
    """

    phase_marks = True

    def __init__(self, device: torch.device, every: int = 10) -> None:
        self._host = [0.0] * len(PHASES)
        self._current: int | None = None
        self._since = 0.0
        self._steps = 0
        #: on CUDA, the stream's time per phase (a callback of its own, told each phase)
        self.stream = StreamSample(every) if device.type == "cuda" else None
        #: host seconds and counts of what ran between steps: "eval", "checkpoint"
        self.outside: dict[str, list[float]] = {}
        self._outside_kind: str | None = None
        self._outside_taken: dict[str, float] = {}  # outside's seconds at the last take

    def on_phase(self, trainer: Any, phase: Phase) -> None:
        """A direct call (the loop hands over marks instead): ``phase`` begins now."""
        self.on_phase_marks(trainer, [(phase, time.perf_counter())])

    def on_phase_marks(self, trainer: Any, marks: PhaseMarks | list) -> None:
        # For each mark: the time since the last one goes to the phase that ran.
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

    def restart(self) -> None:
        """Forget the interval so far and the phase that was running (a run recovered in
        process starts its steps again): the recovery's time goes to no phase, and a
        stream sample under way is dropped. Call after the marks were handed over."""
        self._host = [0.0] * len(PHASES)
        self._steps = 0
        self._current = self._outside_kind = None
        if self.stream is not None:
            self.stream.drop_open()

    def take(self) -> tuple[list[float], int]:
        """Mean host seconds per step of each phase since the last call, and the number
        of steps; resets the interval."""
        steps = max(1, self._steps)
        host = [t / steps for t in self._host]
        self._host = [0.0] * len(PHASES)
        self._steps = 0
        return host, steps

    def take_outside(self) -> dict[str, float]:
        """Host seconds of each kind of :attr:`outside` (eval, checkpoint) since the
        last call, for the step accounting (:mod:`gpufleet.monitor.accounting`)."""
        now = {kind: kept[0] for kind, kept in self.outside.items()}
        taken, self._outside_taken = self._outside_taken, now
        return {kind: seconds - taken.get(kind, 0.0) for kind, seconds in now.items()}

    def device_times(self) -> list[float] | None:
        """Mean CUDA-stream seconds of each phase per sampled step, over the steps
        sampled since the last call (None off CUDA, or when none finished). Call after
        the loop's log-interval sync."""
        return self.stream.take() if self.stream is not None else None


class StreamSample(Callback):
    """Each phase's time on the current CUDA stream, from events recorded at the phase
    changes of one step in every ``every``: from the end of a step ``s`` with ``s %
    every == 2`` (where the time between steps, "other", begins) to the end of the next.
    So the first sample is step 3, after the step whose FLOPs are counted; with
    ``every`` of 3 or more no sample spans a log line (with 2, ``s`` is odd; with 1,
    every step is sampled), and each log interval of ``every`` steps has one.

    Args:
        every: the log interval in steps.
        event: makes a timing event (default: ``torch.cuda.Event(enable_timing=True)``).
    """

    def __init__(self, every: int, event: Callable[[], Any] | None = None) -> None:
        self.every, self._opens = every, min(2, every - 1)
        self._event = event or functools.partial(torch.cuda.Event, enable_timing=True)
        self._on = False  # recording the sampled step's changes
        self._events: list[tuple[int, Any]] = []  # (bucket that starts, or < 0; event)
        self._pool: list[Any] = []

    def on_phase(self, trainer: Any, phase: Phase) -> None:
        if phase is Phase.END:
            if self._on:
                self._record(_SAMPLE_ENDS)
            self._on = trainer.step % self.every == self._opens
        if self._on:
            bucket = _BUCKET.get(phase)
            self._record(-1 if bucket is None else bucket)

    def _record(self, bucket: int) -> None:
        event = self._pool.pop() if self._pool else self._event()
        event.record()
        self._events.append((bucket, event))

    def _ends(self) -> list[int]:
        """Where in the recorded events each sampled step that ended, ends."""
        return [i for i, (bucket, _) in enumerate(self._events) if bucket == _SAMPLE_ENDS]

    def drop_open(self) -> None:
        """Drop a step being sampled (its events back to the pool); the samples that
        ended are kept for :meth:`take`."""
        events, done = self._events, self._ends()
        keep = done[-1] + 1 if done else 0
        self._pool.extend(e for _, e in events[keep:])
        self._events, self._on = events[:keep], False

    def take(self) -> list[float] | None:
        """Mean seconds per phase of the sampled steps that ended since the last call
        (None: none did); a step still being sampled is kept for the next call. Every
        event taken was recorded before the caller's sync, so nothing waits here."""
        events, done = self._events, self._ends()
        if not done:
            return None
        taken, self._events = events[:done[-1] + 1], events[done[-1] + 1:]
        totals = [0.0] * len(PHASES)
        for (bucket, start), (_, end) in itertools.pairwise(taken):
            if bucket >= 0:
                totals[bucket] += start.elapsed_time(end) / 1000.0  # ms -> s
        self._pool.extend(e for _, e in taken)
        return [t / len(done) for t in totals]
