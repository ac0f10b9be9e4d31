"""The optimizer step both loops share (:mod:`gpufleet.train.engine.step`): its pieces
in their order, a non-finite step skipped with the schedule still stepping, what your
own loop's configuration leaves to the loop, and the run's end filled the same way."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from gpufleet.core.phases import Phase
from gpufleet.train.engine.result import FitResult
from gpufleet.train.engine.step import OptimizerStep, abort, finish
from gpufleet.train.scheduling import SchedulerSteps


class _Log(list):
    """The calls each fake piece made, in order."""


class _Precision:
    scales_loss = False

    def __init__(self, log: _Log) -> None:
        self.log = log

    def unscale(self, optimizer) -> None:
        self.log.append("unscale")

    def step(self, optimizer):
        self.log.append("precision.step")
        return optimizer.step()


class _Guard:
    """Says whether to skip; records when it looks and what it was handed."""

    def __init__(self, log: _Log, skip: bool = False, inspects: bool = True) -> None:
        self.log, self.skip, self.inspects = log, skip, inspects
        self.skipped = 0
        self.reported: list[int] = []
        self.norm_seen: object = "never asked"

    def inspect(self, model, step_loss, optimizer) -> None:
        # The gradients as backward left them: not clipped yet.
        self.log.append(("inspect", _largest_grad(model)))

    def should_skip(self, model, step_loss, norm, optimizer) -> bool:
        self.log.append("should_skip")
        self.norm_seen = norm
        self.skipped += self.skip
        return self.skip

    def report(self, step: int, is_main: bool) -> None:
        self.log.append(("report", step))
        self.reported.append(step)


class _Strategy:
    def __init__(self, log: _Log) -> None:
        self.log = log

    def clip_grad_norm(self, model, max_norm, norm_type=2.0):
        # By value first: the norm is measured on the gradients clipped by value.
        self.log.append(("clip_norm", _largest_grad(model)))
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def after_optimizer_step(self, model, step: int) -> None:
        self.log.append(("after_optimizer_step", step))


class _Interval:
    def __init__(self, log: _Log) -> None:
        self.log = log
        self.grad_norm = None

    def add(self, loss, count: int) -> None:
        self.log.append(("interval.add", float(loss), count))


class _SGD(torch.optim.SGD):
    """torch's SGD, its step and zero_grad recorded."""

    def __init__(self, params, log: _Log) -> None:
        super().__init__(params, lr=0.5)
        self.log = log

    def step(self, closure=None):
        self.log.append("optimizer.step")
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.log.append("zero_grad")
        super().zero_grad(set_to_none)


class _Schedules:
    def __init__(self, log: _Log) -> None:
        self.log = log

    def after_step(self, part) -> None:
        self.log.append(("schedule", part.name))


def _largest_grad(model) -> float:
    return max(float(p.grad.abs().max()) for p in model.parameters())


def _run(log: _Log, guard=None, parts=None):
    model = torch.nn.Linear(3, 1)
    optimizer = _SGD(model.parameters(), log)
    part = SimpleNamespace(name="model", model=model, optimizer=optimizer,
                           precision=_Precision(log), guard=guard, scheduler=None)
    phases = SimpleNamespace(announce=lambda phase: log.append(("announce", phase)),
                             hand_over=lambda: log.append("hand_over"))
    callbacks = SimpleNamespace(
        on_step_end=lambda view, step: log.append(("on_step_end", step)),
        on_fit_end=lambda view, result: log.append(("on_fit_end", result.steps)),
        on_exception=lambda view, error: log.append(("on_exception", str(error))),
        failures={"mlflow": "on_log: OSError: full"})
    return SimpleNamespace(
        model=model, parts=parts or [part], strategy=_Strategy(log),
        state=SimpleNamespace(step=0, train_time_s=2.0, samples=64, tokens=640),
        env=SimpleNamespace(is_main=True), phases=phases, callbacks=callbacks, view=None,
        counts=SimpleNamespace(epochs_done=1.5),
        cfg=SimpleNamespace(monitor=SimpleNamespace(report=False)))


def _backward(model) -> torch.Tensor:
    loss = (model(torch.full((2, 3), 10.0)) ** 2).mean()
    loss.backward()
    return loss.detach()


def test_the_built_in_loop_s_step_goes_through_its_pieces_in_order():
    """unscale → guard sees the unclipped gradients → clip by value → by norm → skip
    decided on the clip's norm → step → loss accounted → schedule → zero_grad; then the
    strategy's hook (before the count), the count, END, on_step_end."""
    log = _Log()
    guard = _Guard(log)
    run = _run(log, guard)
    interval = _Interval(log)
    engine = OptimizerStep(run, interval, _Schedules(log), zero_grad=True)
    loss = _backward(run.model)
    unclipped = _largest_grad(run.model)
    assert unclipped > 1.0
    skipped = engine.step_parts(run.parts, {"model": loss}, 2, clip_value=1.0,
                                max_norm=0.5)
    engine.end(skipped)
    assert skipped == []
    assert log == [
        ("announce", Phase.OPTIMIZER), "unscale", ("inspect", unclipped),
        ("clip_norm", 1.0), "should_skip", "precision.step", "optimizer.step",
        ("interval.add", float(loss), 2), ("schedule", "model"), "zero_grad",
        ("after_optimizer_step", 0), ("announce", Phase.END), ("on_step_end", 1)]
    assert guard.norm_seen is interval.grad_norm is not None  # the clip's norm, kept
    assert run.state.step == 1
    assert all(p.grad is None for p in run.model.parameters())  # freed


def test_a_guard_that_checks_on_the_clip_s_norms_is_not_asked_to_inspect():
    log = _Log()
    run = _run(log, _Guard(log, inspects=False))
    engine = OptimizerStep(run, _Interval(log), _Schedules(log))
    engine.step_parts(run.parts, {"model": _backward(run.model)}, 1, max_norm=0.5)
    assert not any(isinstance(e, tuple) and e[0] == "inspect" for e in log)
    assert log.index("unscale") < log.index("should_skip")


def test_a_non_finite_step_is_skipped_and_its_schedule_still_steps():
    """Nothing stepped, no loss accounted, the scheduler stepped without torch's warning
    about a scheduler step before an optimizer step, the gradients freed, the skip
    reported for step 1 before the step ends."""
    log = _Log()
    guard = _Guard(log, skip=True)
    run = _run(log, guard)
    part = run.parts[0]
    part.scheduler = torch.optim.lr_scheduler.StepLR(part.optimizer, step_size=1,
                                                     gamma=0.1)
    run.cfg.sched = SimpleNamespace(interval="step")
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    engine = OptimizerStep(run, _Interval(log), SchedulerSteps(run))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's scheduler warning would raise here
        engine.end(engine.step_parts(run.parts, {"model": _backward(run.model)}, 1))
    assert "optimizer.step" not in log and "precision.step" not in log
    assert not any(isinstance(e, tuple) and e[0] == "interval.add" for e in log)
    assert part.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # scheduled
    assert all(torch.equal(v, before[k]) for k, v in run.model.state_dict().items())
    assert all(p.grad is None for p in run.model.parameters())
    assert guard.reported == [1]
    at = log.index(("report", 1))
    assert log.index(("after_optimizer_step", 0)) < at < log.index(("announce", Phase.END))


def test_your_loop_s_step_leaves_the_schedule_and_zero_grad_to_the_loop():
    """schedules=None, zero_grad=False: the step your loop called (``take``) runs in
    place of the precision's, the loss counts as the backward passes it had, and the
    gradients and learning rate stay as they were for your loop's own calls."""
    log = _Log()
    guard = _Guard(log)
    run = _run(log, guard)
    part = run.parts[0]
    lr = part.optimizer.param_groups[0]["lr"]
    engine = OptimizerStep(run, None, schedules=None, zero_grad=False)
    engine.interval = _Interval(log)  # your loop's first step builds it
    loss = _backward(run.model)
    engine.prepare(run.model, part.optimizer, part.precision, guard, loss)
    engine.clip(run.model, None, 0.5)
    skip, out = engine.after_clip(run.model, part.optimizer, part.precision, guard, loss,
                                  None, 3, take=lambda: part.optimizer.step() or "yours")
    engine.end(())
    assert (skip, out) == (False, "yours")
    assert guard.norm_seen is None  # the clip was your call: no norm handed on
    assert "precision.step" not in log and "zero_grad" not in log
    assert not any(isinstance(e, tuple) and e[0] == "schedule" for e in log)
    assert ("interval.add", float(loss), 3) in log
    assert log.index("should_skip") < log.index("optimizer.step") < \
        log.index(("interval.add", float(loss), 3)) < log.index(("on_step_end", 1))
    assert all(p.grad is not None for p in run.model.parameters())
    assert part.optimizer.param_groups[0]["lr"] == lr


def test_a_step_without_a_backward_accounts_no_loss():
    log = _Log()
    run = _run(log)
    part = run.parts[0]
    engine = OptimizerStep(run, _Interval(log), schedules=None, zero_grad=False)
    _backward(run.model)
    engine.step_or_skip(part.optimizer, part.precision, False, None, 0)
    assert "optimizer.step" in log
    assert not any(isinstance(e, tuple) and e[0] == "interval.add" for e in log)


def test_several_models_step_each_with_a_loss_and_log_the_norm_over_all():
    log = _Log()
    run = _run(log)
    one = run.parts[0]
    other_model = torch.nn.Linear(3, 1)
    other = SimpleNamespace(name="other", model=other_model,
                            optimizer=_SGD(other_model.parameters(), log),
                            precision=_Precision(log), guard=None, scheduler=None)
    idle_model = torch.nn.Linear(3, 1)
    idle = SimpleNamespace(name="idle", model=idle_model,
                           optimizer=_SGD(idle_model.parameters(), _Log()),
                           precision=_Precision(_Log()), guard=None, scheduler=None)
    run.parts = [one, other, idle]
    interval = _Interval(log)
    engine = OptimizerStep(run, interval, _Schedules(log))
    losses = {"model": _backward(one.model), "other": _backward(other_model)}
    norms = [torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in m.parameters()]))
             for m in (one.model, other_model)]
    engine.step_parts(run.parts, losses, 1, max_norm=100.0)
    assert [e for e in log if isinstance(e, tuple) and e[0] == "schedule"] == [
        ("schedule", "model"), ("schedule", "other")]  # the idle model sat it out
    assert float(interval.grad_norm) == pytest.approx(
        float(torch.linalg.vector_norm(torch.stack(norms))))


def test_finish_fills_the_result_before_the_callbacks_read_it():
    log = _Log()
    guard = _Guard(log)
    guard.skipped = 2
    run = _run(log, guard)
    run.state.step = 7
    result = finish(run, FitResult())
    assert (result.steps, result.epochs, result.skipped_steps, result.train_time_s) == \
        (7, 1.5, 2, 2.0)
    assert (result.samples_per_s, result.tokens_per_s) == (32.0, 320.0)
    assert result.callback_errors == {"mlflow": "on_log: OSError: full"}
    assert log == ["hand_over", ("on_fit_end", 7)]


def test_abort_tells_the_callbacks():
    log = _Log()
    abort(_run(log), RuntimeError("lost"))
    assert log == [("on_exception", "lost")]
