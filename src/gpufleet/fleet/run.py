"""What the run's monitors see of an own loop: :class:`FleetRun`.

The phase timer, the watchdog, the system sampler, the metrics file and the advisor
are the same callbacks :func:`gpufleet.train.engine.build.build_run` gives the built-in loop,
and they read the run through the same read-only :class:`~gpufleet.train.engine.view.RunView`.
A :class:`FleetRun` holds the parts that view, the log interval
(:class:`~gpufleet.train.engine.interval.LogInterval`) and the crash report read, filled in as
your loop sets them up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from gpufleet.config import Config
from gpufleet.core.callbacks import CallbackList
from gpufleet.core.phases import PhaseAnnouncer
from gpufleet.launch import DistEnv
from gpufleet.train.engine.result import FitResult
from gpufleet.train.engine.run import Monitors, TrainState

if TYPE_CHECKING:
    from gpufleet.train.engine.view import RunLike


class LoaderCounts:
    """The data position and sample counts of the loaders your loop set up, as the log
    interval and the view read them (``data.epoch``, ``data.take_counts()``)."""

    def __init__(self) -> None:
        self.loaders: list[Any] = []
        self.pin_memory = False
        self.data_copies = 1  # ranks that read each sample (pipeline stages share data)

    @property
    def epoch(self) -> int:
        """The epoch the first loader is reading."""
        return self.loaders[0].epoch if self.loaders else 0

    @property
    def epochs_done(self) -> float:
        return float(self.epoch)

    def take_counts(self) -> tuple[int, int]:
        """Training samples taken since the last call (tokens are not counted)."""
        return sum(loader.take_samples() for loader in self.loaders), 0


class LearningRate:
    """``get_last_lr()`` of the primary optimizer, for the log line (your scheduler,
    if any, is yours to step)."""

    def __init__(self) -> None:
        self.optimizer: torch.optim.Optimizer | None = None

    def get_last_lr(self) -> list[float]:
        if self.optimizer is None:
            return [0.0]
        return [float(g["lr"]) for g in self.optimizer.param_groups]


@dataclass(eq=False)
class FleetRun:
    """The parts of an own-loop run on this rank (the fields a
    :class:`~gpufleet.train.engine.run.Run` has that monitors read).

    Attributes:
        cfg / env / device / run_dir: the planned config, this rank, its device and
            the run directory.
        precision / strategy: from the plan; applied by ``Fleet.setup``.
        model / optimizer: the primary model and optimizer (the first set up).
        scheduler: reads the primary optimizer's learning rate.
        data: the loaders' position and counts.
        nonfinite: the primary optimizer's non-finite guard (None when off).
        monitors / callbacks / phases / view: what watches the run.
        state / result: steps done, training time; the result so far.
    """

    cfg: Config
    env: DistEnv
    device: torch.device
    run_dir: Path
    precision: Any
    strategy: Any
    monitors: Monitors
    run_lock: Any = None
    model: Any = None
    optimizer: Any = None
    scheduler: LearningRate = field(default_factory=LearningRate)
    data: LoaderCounts = field(default_factory=LoaderCounts)
    nonfinite: Any = None
    max_steps: int = 0  # unknown: your loop decides when it ends
    peak_flops: float | None = None
    state: TrainState = field(default_factory=lambda: TrainState(flops_per_step=0))
    result: FitResult = field(default_factory=FitResult)
    callbacks: CallbackList = field(default_factory=lambda: CallbackList([]))
    phases: PhaseAnnouncer = field(default_factory=lambda: PhaseAnnouncer([], None))
    view: Any = None
    #: the built-in loop's training step: none here, your loop is the step
    user_step: Any = None

    @property
    def parts(self) -> list[Any]:
        """The guarded model, as the log interval reads a run's parts (their guards)."""
        return [SimpleNamespace(guard=self.nonfinite)]

    def request_stop(self, reason: str) -> None:
        """Keep the reason; an own loop decides itself when to stop (see
        ``Fleet.should_stop``)."""
        if not self.state.stop_reason:
            self.state.stop_reason = reason or "a stop was requested"

    def close(self) -> None:
        """Stop the watchdog's thread and let go of the run directory."""
        if self.monitors.watchdog is not None:
            self.monitors.watchdog.stop()
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None


if TYPE_CHECKING:  # mypy checks that a FleetRun gives what the shared parts read
    _READ_AS: type[RunLike] = FleetRun


class FleetPart:
    """A part of :class:`~gpufleet.fleet.Fleet` (its setup, collectives, gradient calls,
    checkpoints): Fleet itself gives the run, once this process is a rank."""

    def _rank_run(self) -> FleetRun:
        raise NotImplementedError
