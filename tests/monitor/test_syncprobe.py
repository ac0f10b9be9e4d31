"""The sync probe names the line of your step that called into torch, not torch's own
file; it leaves gpufleet's deliberate reads out and keeps a sync inside torch that
gpufleet called for you (torch's sync-debug mode needs CUDA: here torch's warning is
raised by code that runs as a file of torch's folder)."""

from __future__ import annotations

import os
import sys
import warnings
from types import SimpleNamespace

import torch

import gpufleet
from gpufleet.monitor.syncprobe import SyncProbe

_SYNCS = """
import warnings

def synchronize():
    warnings.warn("called a synchronizing CUDA operation", UserWarning)
"""
_GPUFLEET = """
import warnings

def log_line():  # gpufleet's own read, in its own line
    warnings.warn("called a synchronizing CUDA operation", UserWarning)

def backward(fn):  # gpufleet calling into torch for you
    return fn()
"""


def _runs_in(package: object, source: str, name: str) -> object:
    """Function ``name`` of ``source``, its frames placed in ``package``'s folder (no
    file is written there)."""
    folder = os.path.dirname(os.path.abspath(package.__file__))
    namespace: dict = {}
    exec(compile(source, os.path.join(folder, "_stand_in.py"), "exec"), namespace)
    return namespace[name]


def test_the_probe_names_the_line_that_called_into_torch_and_leaves_out_gpufleets_own():
    synchronize = _runs_in(torch, _SYNCS, "synchronize")  # like torch.cuda.synchronize
    log_line = _runs_in(gpufleet, _GPUFLEET, "log_line")
    backward = _runs_in(gpufleet, _GPUFLEET, "backward")
    modes: list[str] = []
    advisor = SimpleNamespace(syncs=[])
    probe = SyncProbe(advisor, steps=2, first_step=3, set_mode=modes.append)
    before = warnings.showwarning
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        probe.on_step_end(None, 1)  # a warm-up step: nothing probed yet
        assert modes == []
        probe.on_step_end(None, 2)  # the probe starts after step 2
        for _ in range(3):
            line = sys._getframe().f_lineno + 1
            synchronize()  # your step's line
        log_line()  # gpufleet's own read: left out
        backward(synchronize)  # a sync inside torch that gpufleet called: kept
        warnings.warn("an unrelated warning", stacklevel=1)  # shown as usual
        probe.on_step_end(None, 3)
        probe.on_step_end(None, 4)  # two steps probed: it stops
        synchronize()  # after the probe: nobody counts it
    assert modes == ["warn", "default"]
    torch_place = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)),
                               "_stand_in.py")
    ours = os.path.join(os.path.dirname(os.path.abspath(gpufleet.__file__)), "_stand_in.py")
    assert advisor.syncs == [(f"{__file__}:{line}", 3),
                             (f"{torch_place}:5 (called from gpufleet's {ours}:8)", 1)]
    assert [str(w.message) for w in shown] == ["an unrelated warning",
                                               "called a synchronizing CUDA operation"]
    assert warnings.showwarning is before


def test_a_run_that_fails_inside_the_probed_steps_leaves_warnings_as_they_were():
    modes: list[str] = []
    probe = SyncProbe(SimpleNamespace(syncs=[]), steps=5, first_step=3,
                      set_mode=modes.append)
    before, filters = warnings.showwarning, list(warnings.filters)
    probe.on_step_end(None, 2)  # probing from step 3 on
    assert warnings.showwarning is not before
    probe.on_exception(None, RuntimeError("the step failed"))
    assert modes == ["warn", "default"]
    assert warnings.showwarning is before and warnings.filters == filters
