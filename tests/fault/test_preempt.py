"""The preemption watch's signal handlers: the signals it is given, and a watch closed
out of the order the watches were made in (two runs of one process) passes a signal on
to the handler before it instead of keeping it."""

from __future__ import annotations

import signal

from gpufleet.fault.preempt import PREEMPT_SIGNALS, PreemptionWatch


def test_a_watch_catches_only_the_signals_it_is_given():
    before, usr1 = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR1)
    watch = PreemptionWatch(1, distributed=False, signals=PREEMPT_SIGNALS)
    try:
        assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C stays the loop's
        signal.raise_signal(signal.SIGUSR1)
        assert watch.received == signal.SIGUSR1 and watch.should_stop(1)
    finally:
        watch.close()
    assert signal.getsignal(signal.SIGUSR1) == usr1


def test_watches_closed_out_of_order_pass_a_signal_on_to_the_handler_before_them():
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        first = PreemptionWatch(1, distributed=False, signals=(signal.SIGUSR1,))
        second = PreemptionWatch(1, distributed=False, signals=(signal.SIGUSR1,))
        first.close()  # not the reverse order: second's handler stays in place...
        second.close()  # ...and puts back first's, closed already
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # the handler before both got it
        assert first.received is None and second.received is None
    finally:
        signal.signal(signal.SIGUSR1, previous)
