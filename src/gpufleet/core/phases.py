"""The phases of a training step, and how the loop announces them.

The loop announces each part of a step (``phases.announce(Phase.FORWARD)``; for what
runs between steps, ``with phases(Phase.EVAL): ...`` announces on entry). A phase lasts
until the next one is announced, so leaving a block announces nothing.

An announcement is a clock read written into :class:`PhaseMarks`, a buffer allocated
once and reused: that is all a step pays for the run's own monitors (the phase timer,
the all-reduce arrival timer, the watchdog). They read the marks in batches
(:meth:`~gpufleet.core.callbacks.Callback.on_phase_marks`), when a phase outside the
steps begins (log, eval, checkpoint), when the buffer is full and at the end; the
watchdog's thread also reads the newest marks under the buffer's lock. A callback that
overrides :meth:`~gpufleet.core.callbacks.Callback.on_phase` instead still hears each
phase as it begins.

Example:
    >>> seen = []
    >>> class Spy:
    ...     def on_phase(self, view, phase):
    ...         seen.append(phase)
    >>> phases = PhaseAnnouncer([Spy()], view=None)
    >>> with phases(Phase.DATA):
    ...     pass
    >>> phases.marker(Phase.BACKWARD)()
    >>> seen == ["data", "backward"]
    True
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10 has no StrEnum: the same behaviour (str() and format() give the value)
    from enum import Enum

    class StrEnum(str, Enum):
        """An enum whose members are strings, as Python 3.11's ``enum.StrEnum``."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)

from gpufleet.core.ring import RING


class Phase(StrEnum):
    """A part of a training step, or what runs between steps.

    The values are the names callbacks, heartbeats and metrics have always used
    (``Phase.DATA == "data"``).
    """

    DATA = "data"  #: waiting for the next batch
    FORWARD = "forward"
    BACKWARD = "backward"  #: with ddp, the gradient all-reduce that ends it
    OPTIMIZER = "optimizer"  #: unscale, clip, step, zero_grad
    END = "end"  #: the step is done
    LOG = "log"  #: the metrics reduction of a log interval
    EVAL = "eval"
    CHECKPOINT = "checkpoint"


#: The phases that begin a step of your own loop (under Fleet): by then the loop has
#: done what follows the step before (its scheduler, its counters), so its state is a
#: step boundary's.
NEXT_STEP = frozenset({Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.EVAL})


#: Marks the buffer holds; when it is full (a long log interval) it is read mid-interval.
CAPACITY = 1024


class PhaseMarks:
    """The phase changes since the readers last read them: ``phases[i]`` began at
    ``times[i]`` (``time.perf_counter()`` seconds) for ``i < count``.

    Allocated once and reused: marking a phase writes two list slots and a count. The
    loop's thread writes; another thread (the watchdog's) reads the first ``count``
    marks while holding ``lock``, which the loop takes only to hand the marks over and
    start again from the first slot.

    Args:
        capacity: how many marks fit before the readers must read them.
    """

    __slots__ = ("count", "lock", "phases", "times")

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.phases: list[Phase | None] = [None] * capacity
        self.times: list[float] = [0.0] * capacity
        self.count = 0
        self.lock = threading.Lock()

    def __iter__(self) -> Iterator[tuple[Phase, float]]:
        """The marks, oldest first: ``(phase, perf_counter seconds)``."""
        n = self.count
        return zip(self.phases[:n], self.times[:n])  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.count


# A phase outside the steps begins: the readers are handed the marks (the log interval
# reads the phase times; evaluation and checkpoints are timed apart).
_HAND_OVER = frozenset({Phase.LOG, Phase.EVAL, Phase.CHECKPOINT})


class PhaseScope:
    """``with``-block of one phase: announces it on entry (reused, allocates nothing)."""

    __slots__ = ("_announce", "_phase")

    def __init__(self, announce: Callable[[Phase], None], phase: Phase) -> None:
        self._announce, self._phase = announce, phase

    def __enter__(self) -> None:
        self._announce(self._phase)

    def __exit__(self, *exc: object) -> None:
        return None


class PhaseAnnouncer:
    """Marks when each phase begins: in :attr:`marks`, handed to ``readers`` in batches,
    and told to ``listeners`` (callbacks overriding ``on_phase``) one by one.

    Args:
        listeners: the callbacks to tell each phase as it begins, in order.
        view: what listeners and readers receive as their first argument (the run's
            read-only view).
        readers: functions ``read(view, marks)`` that take the marks in batches; each
            is called once here with the empty buffer, so that one watching it from a
            thread holds it from the start.
        capacity: the buffer's size (:data:`CAPACITY`).
    """

    def __init__(self, listeners: Sequence[Any], view: Any,
                 readers: Sequence[Callable[[Any, PhaseMarks], None]] = (),
                 capacity: int = CAPACITY) -> None:
        self._calls = [cb.on_phase for cb in listeners]
        self._readers = list(readers)
        self._view = view
        self._last = capacity - 1
        #: the marks not read yet (allocated once, reused)
        self.marks = PhaseMarks(capacity)
        #: the phase announced last (None before the first)
        self.current: Phase | None = None
        self._scopes = {phase: PhaseScope(self.announce, phase) for phase in Phase}
        for read in self._readers:
            read(view, self.marks)

    def __bool__(self) -> bool:
        return bool(self._calls or self._readers)

    def __call__(self, phase: Phase) -> PhaseScope:
        return self._scopes[phase]

    def announce(self, phase: Phase) -> None:
        """Phase ``phase`` begins (the ``with`` form calls this on entry)."""
        marks = self.marks
        i = marks.count
        marks.phases[i] = phase
        marks.times[i] = time.perf_counter()
        marks.count = i + 1  # after the slots: the watchdog's thread reads up to count
        self.current = phase
        if phase is Phase.OPTIMIZER:  # backward returned: DDP waited for every bucket
            RING.leave_all()
        if i == self._last or phase in _HAND_OVER:
            self.hand_over()
        for call in self._calls:
            call(self._view, phase)

    def hand_over(self) -> None:
        """The readers read every mark so far; the buffer starts again. The loop calls
        it before ``on_fit_end`` (so the readers have every mark); announcing log,
        eval or checkpoint, or filling the buffer, calls it too."""
        marks = self.marks
        with marks.lock:
            try:
                for read in self._readers:
                    read(self._view, marks)
            finally:
                marks.count = 0

    def marker(self, phase: Phase) -> Callable[[], None]:
        """A no-argument function announcing ``phase``, for code that learns where a
        phase begins only from inside (a strategy's backward)."""
        return functools.partial(self.announce, phase)  # no Python frame of its own
