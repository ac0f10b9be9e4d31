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
    from gpufleet.train.engine.view import RunView
    from gpufleet.train.guard.nonfinite import NonFiniteGuard
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
    """The parts of one training run on this rank, built once by ``build_run``.

    Attributes:
        cfg: the resolved config, as written to the run directory's config.toml.
        env: this rank (rank, world size, node).
        device / run_dir: where it computes and where it writes.
        precision / strategy: mixed precision, and the parallel plan applied to the model.
        model / optimizer / scheduler / loss_fn: what is trained and how.
        data: the training batches and the data position (:class:`TrainStream`).
        evaluator: evaluation on the held-out data (None without eval data).
        checkpointer: saves and restores the whole training state.
        nonfinite: skips steps whose loss or gradients are not finite (None when off).
        max_steps: the step the run ends at (run.max_steps or run.max_epochs' steps).
        peak_flops: the device's peak FLOP/s for MFU (None when unknown).
        resume_from: the checkpoint to resume from, or None for a fresh start.
        run_lock: this run directory's lock, when this process holds it.
        monitors: phase timer, watchdog, preemption watch, system sampler, advisor.
        callbacks: every callback, the run's own first.
        phases: tells the callbacks which phase of a step begins.
        view: the read-only view callbacks are given.
        state / result: what the loop changes, and what it reports.
        parts: every model with its optimizer, scheduler, scaler and guard (one part,
            the fields above, unless several models are trained).
        user_step: your training step (:mod:`gpufleet.train.engine.steps`), or None.
        recovery: goes on without lost ranks in process (:mod:`gpufleet.train.recovery.recovery`;
            snapshots on, replicated state), or None.
    """

    cfg: Config
    env: DistEnv
    device: torch.device
    run_dir: Path
    precision: Precision
    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: Any
    data: TrainStream
    evaluator: Evaluator | None
    checkpointer: Checkpointer
    nonfinite: NonFiniteGuard | None
    max_steps: int
    peak_flops: float | None
    resume_from: Path | None
    run_lock: RunLock | None
    monitors: Monitors
    state: TrainState = field(default_factory=TrainState)
    result: FitResult = field(default_factory=FitResult)
    # Set last by build_run: the callbacks are built with the view, which reads the run.
    callbacks: CallbackList = field(default_factory=lambda: CallbackList([]))
    phases: PhaseAnnouncer = field(default_factory=lambda: PhaseAnnouncer([], None))
    view: RunView | None = None
    parts: list[ModelPart] = field(default_factory=list)
    user_step: UserStep | None = None
    recovery: Recovery | None = None  # in-process recovery after a lost node, or None

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
        self.checkpointer.wait()  # a checkpoint written in the background is complete
        if self.recovery is not None and self.recovery.growing is not None:
            self.recovery.growing.close()
        if mon.watchdog is not None:
            mon.watchdog.stop()
        if self.run_lock is not None:
            self.run_lock.release()
        if mon.preemption is not None:
            mon.preemption.close()
        self.data.close()  # last: the rest is let go of even if a worker fails to stop


if TYPE_CHECKING:  # mypy checks that a Run gives what the shared parts read
    from gpufleet.train.engine.view import RunLike

    _READ_AS: type[RunLike] = Run
