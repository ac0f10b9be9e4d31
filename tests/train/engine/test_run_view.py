"""Callbacks get a read-only view of the run, and phases arrive as the Phase enum."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from gpufleet.core.callbacks import Callback
from gpufleet.core.phases import Phase
from gpufleet.train.engine.view import RunView


class _Watch(Callback):
    """Records what the view shows at each hook and whether it can be changed."""

    def __init__(self) -> None:
        self.views: set[type] = set()
        self.steps: list[int] = []
        self.phases: list[Phase] = []
        self.refused: list[str] = []

    def on_fit_start(self, view):
        self.views.add(type(view))
        self.start = (view.step, view.phase, view.max_steps, Path(view.run_dir).is_dir())
        for name, value in (("step", 99), ("cfg", None), ("model", None)):
            try:
                setattr(view, name, value)
            except AttributeError:
                self.refused.append(name)

    def on_phase(self, view, phase):
        self.phases.append(phase)
        assert view.phase == phase  # the view reports the phase being announced

    def on_step_end(self, view, step):
        self.views.add(type(view))
        self.steps.append(view.step)

    def on_fit_end(self, view, result):
        self.end = (view.result is result, view.epochs_done > 0, view.config is view.cfg)


def _fit(tmp_path, callbacks, **overrides):
    torch.manual_seed(0)
    base = {"run.out_dir": str(tmp_path / "runs"), "run.max_steps": 4, "log.progress": "off",
            "log.every": 2, "data.batch_size": 32, "data.num_workers": 0}
    return gpufleet.fit(toyjob.make_model(), toyjob.make_data(), loss_fn=F.mse_loss,
                        overrides={**base, **overrides}, callbacks=callbacks)


def test_callbacks_see_a_read_only_view_with_live_values(tmp_path):
    watch = _Watch()
    result = _fit(tmp_path, [watch], **{"run.eval_every": 0})
    assert result.steps == 4
    assert watch.views == {RunView}
    assert watch.start == (0, "setup", 4, True)
    assert watch.refused == ["step", "cfg", "model"]
    assert watch.steps == [1, 2, 3, 4]  # read live from the run, not copied once
    assert watch.end == (True, True, True)


def test_phases_arrive_in_step_order_as_the_enum(tmp_path):
    watch = _Watch()
    _fit(tmp_path, [watch], **{"optim.grad_accum": 2, "run.max_steps": 2,
                               "checkpoint.every": 2})
    assert all(type(p) is Phase for p in watch.phases)
    step = [Phase.DATA, Phase.FORWARD, Phase.BACKWARD] * 2 + [Phase.OPTIMIZER, Phase.END]
    assert watch.phases[:len(step)] == step
    second = watch.phases[len(step):]
    # The second step ends the log interval, then writes its checkpoint.
    assert second[-2:] == [Phase.LOG, Phase.CHECKPOINT]
    assert second[:-2] == step


def test_a_crash_report_names_the_phase_without_a_watchdog(tmp_path):
    class Boom(Callback):
        def on_step_end(self, view, step):
            if step == 2:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, [Boom()], **{"fault.watchdog": False})
    report = next((tmp_path / "runs").rglob("rank-0.txt")).read_text()
    assert "step: 2 (steps done)" in report and "phase: end" in report


def test_the_advisor_gets_time_outside_steps_from_the_phase_timer_it_is_given(tmp_path):
    """Not from the trainer: the advisor is handed the phase timer when it is built."""
    import time
    from types import SimpleNamespace

    from gpufleet.monitor.advisor import Advisor
    from gpufleet.monitor.diagnose import RunFacts
    from gpufleet.monitor.phases import PHASES, PhaseTimer

    timer = PhaseTimer(torch.device("cpu"))
    advisor = Advisor(RunFacts(), tmp_path, skip_intervals=0, phase_timer=timer)
    view = SimpleNamespace(step=0, log_seconds={})
    timer.on_fit_start(view)
    advisor.on_fit_start(view)
    timer.on_phase(view, Phase.EVAL)
    time.sleep(0.02)
    timer.on_phase(view, Phase.DATA)  # evaluation over: its time is kept apart
    row = {"rank": 0, **{name: 0.001 for name in PHASES}}
    advisor.on_log(view, 1, {"rank_phases": [row], "step_time_s": 0.005})
    seconds, count = advisor.summary().outside["eval"]
    assert seconds >= 0.02 and count == 1


def test_a_run_built_by_hand_trains_like_fit(tmp_path):
    """build_run makes the parts once; Trainer(run) only changes the run's state and
    ends with the weights gpufleet.fit gives for the same config."""
    from gpufleet import Trainer, build_run, load_config

    overrides = {"run.out_dir": str(tmp_path / "runs"), "run.max_steps": 4,
                 "log.progress": "off", "log.every": 2, "data.batch_size": 32,
                 "data.num_workers": 0, "run.eval_every": 0}
    torch.manual_seed(0)
    model = toyjob.make_model()
    run = build_run(load_config(overrides=overrides), model, toyjob.make_data(),
                    loss_fn=F.mse_loss)
    assert (run.max_steps, run.state.step, run.data.epoch) == (4, 0, 0)
    assert run.view.strategy is run.strategy and run.view.model is run.model
    assert not Path(run.run_dir, "checkpoints").exists()  # built, not trained yet
    result = Trainer(run).fit()
    assert (result.steps, run.state.step, run.state.saved_step) == (4, 4, 4)

    torch.manual_seed(0)
    reference = toyjob.make_model()
    _fit_into(tmp_path / "fit", reference)
    for mine, theirs in zip(run.strategy.unwrap(run.model).parameters(),
                            reference.parameters()):
        assert torch.equal(mine, theirs)


def _fit_into(out_dir, model):
    gpufleet.fit(model, toyjob.make_data(), loss_fn=F.mse_loss,
                 overrides={"run.out_dir": str(out_dir), "run.max_steps": 4,
                            "log.progress": "off", "log.every": 2, "data.batch_size": 32,
                            "data.num_workers": 0, "run.eval_every": 0})
