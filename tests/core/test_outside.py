"""Which errors caught around a callback are its own (contained) and which are the run's."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from gpufleet.core.outside import from_outside


def _caught(fn):
    try:
        fn()
    except BaseException as e:  # what _tolerant would see
        return e
    raise AssertionError("fn raised nothing")


def test_a_callbacks_own_bug_is_its_own():
    assert not from_outside(_caught(lambda: {}["missing"]))
    assert not from_outside(_caught(lambda: 1 / 0))


def test_an_error_raised_by_a_signal_handler_is_the_runs():
    def handler(signum, frame):
        raise RuntimeError("raised in a signal handler")

    def callback_code():
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(2)  # the handler runs here, in the callback's frame

    previous = signal.signal(signal.SIGUSR1, handler)  # installed for the run, as torch's
    try:
        error = _caught(callback_code)
        assert isinstance(error, RuntimeError) and from_outside(error)
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("error", [
    dist.DistBackendError("gloo: connection closed by peer"),
    dist.DistNetworkError("store unreachable"), KeyboardInterrupt(), SystemExit(1),
    MemoryError(), RuntimeError("CUDA error: device-side assert triggered")])
def test_errors_of_the_run_by_their_type(error):
    assert from_outside(error)


def test_a_callbacks_wrapper_around_the_runs_error_still_stops_the_run():
    def wraps():
        try:
            raise dist.DistBackendError("peer gone")
        except dist.DistBackendError as e:
            raise ValueError("sink could not read the metrics") from e

    assert from_outside(_caught(wraps))
    assert not from_outside(ValueError("no cause"))
