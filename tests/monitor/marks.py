"""Phase marks as the loop would have written them, for the readers' tests."""

from __future__ import annotations

from gpufleet.core.phases import Phase, PhaseMarks


def marks_of(timed: list[tuple[Phase, float]]) -> PhaseMarks:
    """A buffer holding ``timed`` (``(phase, perf_counter seconds)``, oldest first)."""
    marks = PhaseMarks(len(timed))
    for i, (phase, at) in enumerate(timed):
        marks.phases[i], marks.times[i] = phase, at
    marks.count = len(timed)
    return marks
