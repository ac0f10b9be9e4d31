"""The op clock: a sampled step's time inside operators, per phase, spaced by its own
cost; and the host overhead the step accounting takes from it."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from gpufleet.core.phases import Phase
from gpufleet.monitor.accounting import PARTS, mean_accounting, rank_accounting
from gpufleet.monitor.opclock import OPS, OpClock


def _view(compile_: bool = False, model: torch.nn.Module | None = None):
    cfg = types.SimpleNamespace(perf=types.SimpleNamespace(compile=compile_))
    return types.SimpleNamespace(config=cfg, model=model or torch.nn.Linear(4, 4))


def _step(clock: OpClock, view, model, opt, x) -> None:
    """One training step with its phases told to the clock, as the announcer does."""
    clock.on_phase(view, Phase.DATA)
    clock.on_phase(view, Phase.FORWARD)
    loss = model(x).square().mean()
    clock.on_phase(view, Phase.BACKWARD)
    loss.backward()
    clock.on_phase(view, Phase.OPTIMIZER)
    opt.step()
    opt.zero_grad()
    clock.on_phase(view, Phase.END)


def test_a_sampled_step_counts_each_phase_and_the_next_waits_for_its_budget():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    view, x = _view(model=model), torch.randn(16, 32)
    clock = OpClock(budget=1e-9, first_step=2)  # a budget no second sample fits in
    assert clock.take()[:3] == [-1.0, -1.0, -1.0]  # not measured yet
    for _ in range(2):
        _step(clock, view, model, opt, x)
    assert clock.take()[:3] == [-1.0, -1.0, -1.0]  # the first steps are not sampled
    _step(clock, view, model, opt, x)  # the sample
    assert _get_current_dispatch_mode() is None  # the mode ended with the step
    row = dict(zip(OPS, clock.take()))
    assert all(row[f"ops_{p}"] > 0 for p in ("forward", "backward", "optimizer"))
    # Forward: addmm, tanh, addmm and the loss; backward has more (a gradient each).
    assert 4 <= row["count_forward"] < row["count_backward"]
    assert row["count_optimizer"] >= 1
    first = clock.take()
    for _ in range(3):
        _step(clock, view, model, opt, x)
    assert clock.take() == first  # spaced by its cost: no second sample yet


def test_a_generous_budget_samples_again_and_compiled_models_are_left_alone():
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    clock = OpClock(budget=1.0, first_step=0)
    _step(clock, _view(model=model), model, opt, x)
    first = clock.take()
    _step(clock, _view(model=model), model, opt, x)
    assert clock.take() != first  # sampled again: a new measurement
    off = OpClock(first_step=0)
    _step(off, _view(compile_=True, model=model), model, opt, x)
    assert off.take()[:3] == [-1.0, -1.0, -1.0]


def test_a_step_that_raises_leaves_no_mode_behind():
    clock = OpClock(first_step=0)
    view = _view()
    clock.on_phase(view, Phase.DATA)
    assert _get_current_dispatch_mode() is not None
    clock.on_exception(view, RuntimeError("a step failed"))
    assert _get_current_dispatch_mode() is None
    assert clock.take()[:3] == [-1.0, -1.0, -1.0]  # the half sample is not kept


def _phases(*rows):
    keys = ("data", "forward", "backward", "optimizer", "other")
    return [{"rank": r, **dict(zip(keys, row))} for r, row in enumerate(rows)]


def _ops(fwd, bwd, opt, counts=(10.0, 20.0, 5.0)):
    return dict(zip(OPS, (fwd, bwd, opt, *counts)))


def test_host_overhead_is_what_the_compute_phases_spend_outside_operators():
    # Rank 0: forward 3 ms of which 2 in operators, backward 10 ms of which 6 waited in
    # the all-reduce and 3 in operators, optimizer 1 ms of which 0.5 in operators.
    rows = rank_accounting(_phases((0.002, 0.003, 0.010, 0.001, 0.0005)),
                           [{"wait": 0.006, "wait_fwd": 0.0}],
                           [{"wall": 0.0165, "eval": 0.0, "checkpoint": 0.0}],
                           [_ops(0.002, 0.003, 0.0005)])
    (row,) = rows
    assert row["forward"] == pytest.approx(0.002) and row["backward"] == pytest.approx(0.003)
    assert row["optimizer"] == pytest.approx(0.0005)
    assert row["host"] == pytest.approx(0.001 + 0.001 + 0.0005)
    assert row["ops"] == {"forward": 10.0, "backward": 20.0, "optimizer": 5.0}
    # Host only splits phases: the parts still sum to the clock, the residual is the same.
    assert sum(row[p] or 0.0 for p in PARTS) == pytest.approx(0.0165)
    assert row["residual"] == pytest.approx(0.0)


def test_a_stale_sample_longer_than_its_phase_takes_the_whole_phase_never_more():
    (row,) = rank_accounting(_phases((0.0, 0.002, 0.004, 0.001, 0.0)), None,
                             [{"wall": 0.007, "eval": 0.0, "checkpoint": 0.0}],
                             [_ops(0.005, 0.001, 0.001)])
    assert row["forward"] == pytest.approx(0.002)  # capped: the sample was slower
    assert row["host"] == pytest.approx(0.003)
    assert row["residual"] == pytest.approx(0.0)


def test_without_a_sample_host_is_not_measured_and_means_mix_measured_intervals():
    unsampled = rank_accounting(_phases((0.0, 0.002, 0.004, 0.001, 0.0)), None,
                                [{"wall": 0.007, "eval": 0.0, "checkpoint": 0.0}],
                                [_ops(-1.0, -1.0, -1.0, (0.0, 0.0, 0.0))])
    assert unsampled[0]["host"] is None and unsampled[0]["forward"] == 0.002
    sampled = rank_accounting(_phases((0.0, 0.002, 0.004, 0.001, 0.0)), None,
                              [{"wall": 0.007, "eval": 0.0, "checkpoint": 0.0}],
                              [_ops(0.001, 0.002, 0.0005)])
    mean = mean_accounting([unsampled, sampled], [1, 1])[0]
    assert mean["host"] == pytest.approx(0.5 * 0.0035)  # the unsampled interval: 0
    assert mean["ops"]["backward"] == 20.0
    assert mean_accounting([unsampled], [1])[0]["host"] is None
