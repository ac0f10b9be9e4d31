"""A training run as explicit parts: :class:`Run` (what :func:`~gpufleet.train.engine.build.
build_run` made from the config) and :class:`TrainState` (what the loop changes).

Everything a step touches is a field here, named for what it holds; nothing is found by
scanning lists or reaching into another component. The loop
(:class:`~gpufleet.train.loop.Trainer`) reads these parts and changes only the state;
callbacks see both through a read-only :class:`~gpufleet.train.engine.view.RunView`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpufleet.config import Config
from gpufleet.core.callbacks import CallbackList
from gpufleet.core.phases import PhaseAnnouncer
from gpufleet.errors import ConfigError
from gpufleet.launch import DistEnv
from gpufleet.train.checkpoint.checkpointer import Checkpointer
from gpufleet.train.engine.evaluator import Evaluator
from gpufleet.train.engine.result import FitResult
from gpufleet.train.engine.state import Monitors, TrainState
from gpufleet.train.engine.stream import TrainStream

if TYPE_CHECKING:
    from gpufleet.parallel.base import Strategy
    from gpufleet.precision import Precision
    from gpufleet.train.checkpoint.runlock import RunLock
    from gpufleet.train.engine.steps import UserStep
    from gpufleet.train.engine.view import DataCounts, RunView
    from gpufleet.train.guard.nonfinite import NonFiniteGuard
    from gpufleet.train.recovery.loopstate import LoopState
    from gpufleet.train.recovery.recovery import Recovery


@dataclass(eq=False)
class ModelPart:
    """One model of the run and what steps it: its optimizer, scheduler, loss scaler
    (the precision object; under fp16 one ``GradScaler`` per optimizer) and non-finite
    guard. A run of one model has one part, made of the run's own fields.

    Attributes:
        name: the model's name (``"model"`` for a run of one; the dict key otherwise).
        model: the model as the strategy placed it.
        params: its parameters that take gradients (what its backward reaches).
    """

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: Precision
    guard: NonFiniteGuard | None
    params: list[nn.Parameter] = field(default_factory=list)
    #: what the model is built from again after a lost node, where its state is
    #: sharded (a gpufleet.train.recovery.reshard.Source; None elsewhere)
    source: Any = None


@dataclass(eq=False)
class Run:
    """The parts of one training run on this rank, built once: by ``build_run`` for the
    built-in loop, by :func:`~gpufleet.train.engine.build.build_own_loop_run` for your own
    loop under :class:`~gpufleet.Fleet` (whose setup calls fill in the model, optimizer
    and parts; the parts the built-in loop alone has stay None there).

    Attributes:
        cfg: the resolved config, as written to the run directory's config.toml.
        env: this rank (rank, world size, node).
        device / run_dir: where it computes and where it writes.
        precision / strategy: mixed precision, and the parallel plan applied to the model.
        monitors: phase timer, watchdog, preemption watch, system sampler, advisor.
        counts: the data position and the samples and tokens taken, as the log interval
            and the view read them: the stream (``data``) in the built-in loop, the
            loaders your loop set up in yours.
        model / optimizer / scheduler: the primary model, its optimizer and scheduler
            (None in your loop until ``Fleet.setup``; the scheduler None where there is
            none of yours).
        loss_fn: the built-in loop's loss (None in your loop).
        data: the built-in loop's training batches (:class:`TrainStream`; None in your
            loop, which reads its own loaders).
        evaluator: evaluation on the held-out data (None without eval data, and in your
            loop).
        checkpointer: saves and restores the whole training state (None in your loop,
            which saves through ``Fleet.save``).
        nonfinite: skips steps whose loss or gradients are not finite (None when off).
        max_steps: the step the run ends at (run.max_steps or run.max_epochs' steps; 0:
            your loop decides).
        peak_flops: the device's peak FLOP/s for MFU (None when unknown).
        resume_from: the checkpoint to resume from, or None for a fresh start.
        run_lock: this run directory's lock, when this process holds it.
        callbacks: every callback, the run's own first.
        phases: tells the callbacks which phase of a step begins.
        view: the read-only view callbacks are given.
        state / result: what the loop changes, and what it reports.
        parts: every model with its optimizer, scheduler, scaler and guard (one part,
            the fields above, unless several models are trained; none in your loop
            before its first optimizer is set up).
        user_step: your training step (:mod:`gpufleet.train.engine.steps`), or None.
        recovery: goes on without lost ranks in process (:mod:`gpufleet.train.recovery.recovery`;
            snapshots on, replicated state), or None.
        loop_state: the loop's state as snapshots capture it and recovery restores it
            (:class:`~gpufleet.train.recovery.loopstate.LoopState`: the built-in loop's
            checkpointer and stream, or the state your loop registered with
            ``fleet.register_state``), or None (your loop, none registered).
    """

    cfg: Config
    env: DistEnv
    device: torch.device
    run_dir: Path
    precision: Precision
    strategy: Strategy
    monitors: Monitors
    counts: DataCounts
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    loss_fn: Any = None
    data: TrainStream | None = None
    evaluator: Evaluator | None = None
    checkpointer: Checkpointer | None = None
    nonfinite: NonFiniteGuard | None = None
    max_steps: int = 0
    peak_flops: float | None = None
    resume_from: Path | None = None
    run_lock: RunLock | None = None
    state: TrainState = field(default_factory=TrainState)
    result: FitResult = field(default_factory=FitResult)
    # Set last by build_run: the callbacks are built with the view, which reads the run.
    callbacks: CallbackList = field(default_factory=lambda: CallbackList([]))
    phases: PhaseAnnouncer = field(default_factory=lambda: PhaseAnnouncer([], None))
    view: RunView | None = None
    parts: list[ModelPart] = field(default_factory=list)
    user_step: UserStep | None = None
    recovery: Recovery | None = None  # in-process recovery after a lost node, or None
    loop_state: LoopState | None = None  # what snapshots capture and recovery restores

    @property
    def stream(self) -> TrainStream:
        """The built-in loop's training batches (``data``), which its loop, checkpoints
        and recovery read."""
        if self.data is None:
            raise ConfigError("this run reads no training stream of gpufleet's: it is your "
                              "own loop's (Fleet), whose loaders are set up by "
                              "fleet.setup_dataloaders.")
        return self.data

    @property
    def saver(self) -> Checkpointer:
        """The checkpointer (``checkpointer``), which the built-in loop, its snapshots and
        its recovery use."""
        if self.checkpointer is None:
            raise ConfigError("this run has no checkpointer of gpufleet's: it is your own "
                              "loop's (Fleet), which saves through fleet.save.")
        return self.checkpointer

    def request_stop(self, reason: str) -> None:
        """Ask the run to stop after the current step (see RunView.request_stop)."""
        if self.monitors.preemption is None and self.env.world_size > 1:
            raise ConfigError(
                "a stop was requested, and the ranks of this run never agree on stopping: "
                "fault.preempt_check_every = 0. Set it to N > 0 (the ranks then agree "
                "every N steps, one small all-reduce).")
        if not self.state.stop_reason:
            self.state.stop_reason = reason or "a stop was requested"

    def close(self) -> None:
        """Stop the watchdog's thread and the data workers, let go of the run directory
        and the signal handlers; called once when training ends, however it ends."""
        mon = self.monitors
        if self.checkpointer is not None:  # a checkpoint written in the background is
            self.checkpointer.wait()       # complete
        if self.recovery is not None and self.recovery.growing is not None:
            self.recovery.growing.close()
        if mon.watchdog is not None:
            mon.watchdog.stop()
        if self.run_lock is not None:
            self.run_lock.release()
        if mon.preemption is not None:
            mon.preemption.close()
        if self.data is not None:  # last: the rest is let go of even if a worker fails
            self.data.close()


if TYPE_CHECKING:  # mypy checks that a Run gives what the shared parts read
    from gpufleet.train.engine.view import RunLike

    _READ_AS: type[RunLike] = Run
