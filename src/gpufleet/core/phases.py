"""The phases of a training step, and how the loop announces them.

The loop announces each part of a step (``phases.announce(Phase.FORWARD)``; for what
runs between steps, ``with phases(Phase.EVAL): ...`` announces on entry): every callback
that overrides :meth:`~gpufleet.core.callbacks.Callback.on_phase` (the phase timer, the
watchdog) hears that the phase begins. A phase lasts until the next one is announced,
so leaving a block announces nothing.

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
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any


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


class _Scope:
    """``with``-block of one phase: announces it on entry (reused, allocates nothing)."""

    __slots__ = ("_announce", "_phase")

    def __init__(self, announce: Callable[[Phase], None], phase: Phase) -> None:
        self._announce, self._phase = announce, phase

    def __enter__(self) -> None:
        self._announce(self._phase)

    def __exit__(self, *exc: object) -> None:
        return None


class PhaseAnnouncer:
    """Tells ``listeners`` (callbacks overriding ``on_phase``) when each phase begins.

    Args:
        listeners: the callbacks to tell, in order.
        view: what they receive as their first argument (the run's read-only view).
    """

    def __init__(self, listeners: Sequence[Any], view: Any) -> None:
        self._calls = [cb.on_phase for cb in listeners]
        self._view = view
        #: the phase announced last (None before the first)
        self.current: Phase | None = None
        self._scopes = {phase: _Scope(self.announce, phase) for phase in Phase}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def __call__(self, phase: Phase) -> _Scope:
        return self._scopes[phase]

    def announce(self, phase: Phase) -> None:
        """Phase ``phase`` begins (the ``with`` form calls this on entry)."""
        self.current = phase
        for call in self._calls:
            call(self._view, phase)

    def marker(self, phase: Phase) -> Callable[[], None]:
        """A no-argument function announcing ``phase``, for code that learns where a
        phase begins only from inside (a strategy's backward)."""
        return functools.partial(self.announce, phase)  # no Python frame of its own
