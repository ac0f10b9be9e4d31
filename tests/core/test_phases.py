"""The phase announcer: marks in a reused buffer, read in batches; live listeners."""

from __future__ import annotations

import tracemalloc

from gpufleet.core.callbacks import Callback, CallbackList
from gpufleet.core.phases import Phase, PhaseAnnouncer

STEP = [Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.END]


class _Reader(Callback):
    phase_marks = True

    def __init__(self) -> None:
        self.batches: list[list[Phase]] = []
        self.live: list[Phase] = []

    def on_phase(self, view, phase):  # not called: it reads the marks
        self.live.append(phase)

    def on_phase_marks(self, view, marks):
        self.batches.append([phase for phase, _ in marks])


class _Listener(Callback):
    def __init__(self) -> None:
        self.seen: list[Phase] = []

    def on_phase(self, view, phase):
        self.seen.append(phase)


def _announcer(*callbacks, capacity=1024):
    callbacks = CallbackList(list(callbacks))
    return PhaseAnnouncer(callbacks.phase_listeners, None, callbacks.mark_readers,
                          capacity=capacity)


def test_readers_get_the_marks_in_batches_and_listeners_each_phase():
    reader, listener = _Reader(), _Listener()
    phases = _announcer(reader, listener)
    for phase in STEP * 2:
        phases.announce(phase)
    assert reader.batches == [[]]  # the empty buffer once, at the start; nothing per step
    assert listener.seen == STEP * 2  # a plain on_phase still hears each phase at once
    phases.announce(Phase.LOG)  # a phase outside the steps hands the marks over
    with phases(Phase.EVAL):
        pass
    phases.announce(Phase.DATA)
    phases.hand_over()
    assert reader.batches[1:] == [STEP * 2 + [Phase.LOG], [Phase.EVAL], [Phase.DATA]]
    assert reader.live == []
    assert phases.current == Phase.DATA and len(phases.marks) == 0


def test_a_full_buffer_is_handed_over_and_the_marks_keep_their_order():
    reader = _Reader()
    phases = _announcer(reader, capacity=4)
    for phase in STEP:
        phases.announce(phase)
    phases.hand_over()
    assert reader.batches == [[], STEP[:4], STEP[4:]]


def test_marks_are_clock_reads_in_order():
    phases = _announcer(_Reader())
    for phase in STEP:
        phases.announce(phase)
    marks = list(phases.marks)
    assert [p for p, _ in marks] == STEP
    times = [t for _, t in marks]
    assert times == sorted(times)


def test_marking_a_phase_keeps_no_memory():
    phases = _announcer(_Reader())
    for phase in STEP * 170:  # every slot used below has held a mark once
        phases.announce(phase)
    phases.hand_over()
    for phase in STEP * 10:
        phases.announce(phase)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(150):  # 750 marks: fewer than the buffer holds, no hand-over
            for phase in STEP:
                phases.announce(phase)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # Each mark replaces a float in a preallocated slot; a list append or an object kept
    # per mark would hold at least 750 * 24 bytes.
    assert grown < 2000, grown
    assert len(phases.marks) == 50 + 750
