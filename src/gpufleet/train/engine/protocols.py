"""What the shared parts of the engine read of a run: :class:`RunLike`.

The run's own callbacks (:func:`~gpufleet.train.engine.monitors.own_callbacks`), the
log interval (:class:`~gpufleet.train.engine.interval.LogInterval`) and the callbacks'
view (:class:`~gpufleet.train.engine.view.RunView`) serve gpufleet's loop
(:class:`~gpufleet.train.engine.run.Run`) and your own loop through
:class:`~gpufleet.Fleet` (:class:`~gpufleet.fleet.run.FleetRun`) alike. These
Protocols declare what they read; both run objects provide it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from gpufleet.config import Config
    from gpufleet.core.callbacks import CallbackList
    from gpufleet.core.phases import PhaseAnnouncer
    from gpufleet.launch import DistEnv
    from gpufleet.train.engine.result import FitResult
    from gpufleet.train.engine.run import Monitors, TrainState
    from gpufleet.train.engine.steps import UserStep
    from gpufleet.train.engine.view import RunView
    from gpufleet.train.guard.nonfinite import NonFiniteGuard


class DataCounts(Protocol):
    """The data position and the sample counts of a run's training data."""

    @property
    def epoch(self) -> int:
        """The epoch being read."""
        ...

    @property
    def epochs_done(self) -> float:
        """Passes over the data, as a float."""
        ...

    @property
    def pin_memory(self) -> bool:
        """Batches are pinned."""
        ...

    @property
    def data_copies(self) -> int:
        """Ranks that read each sample (pipeline stages read the same data)."""
        ...

    def take_counts(self) -> tuple[int, int]:
        """Training samples and tokens taken since the last call."""
        ...


class LearningRates(Protocol):
    """What the log line reads of the scheduler: the current learning rates."""

    def get_last_lr(self) -> list[float]:
        """The learning rate of each parameter group."""
        ...


class GuardedPart(Protocol):
    """A model of the run with its non-finite guard (None when off)."""

    @property
    def guard(self) -> NonFiniteGuard | None:
        """Its non-finite guard."""
        ...


class RunLike(Protocol):
    """A run as the monitors, the log interval and the callbacks' view read it."""

    @property
    def cfg(self) -> Config:
        """The resolved config."""
        ...

    @property
    def env(self) -> DistEnv:
        """This rank."""
        ...

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        ...

    @property
    def run_dir(self) -> Path:
        """Where the run writes."""
        ...

    @property
    def strategy(self) -> Any:
        """The parallel plan (a :class:`~gpufleet.parallel.base.Strategy`)."""
        ...

    @property
    def precision(self) -> Any:
        """Mixed precision (a :class:`~gpufleet.precision.Precision`)."""
        ...

    @property
    def model(self) -> Any:
        """The (primary) model as the strategy placed it (None before it is set up)."""
        ...

    @property
    def optimizer(self) -> Any:
        """The (primary) optimizer (None before it is set up)."""
        ...

    @property
    def scheduler(self) -> LearningRates:
        """The learning rates, as the log line reads them."""
        ...

    @property
    def data(self) -> DataCounts:
        """The data position and counts."""
        ...

    @property
    def nonfinite(self) -> NonFiniteGuard | None:
        """The (primary) non-finite guard, None when off."""
        ...

    @property
    def parts(self) -> Sequence[GuardedPart]:
        """Every model with its guard."""
        ...

    @property
    def user_step(self) -> UserStep | None:
        """The built-in loop's training step of yours, None where there is none."""
        ...

    @property
    def max_steps(self) -> int:
        """The step the run ends at (0: the loop decides)."""
        ...

    @property
    def peak_flops(self) -> float | None:
        """The device's peak FLOP/s (None when unknown)."""
        ...

    @property
    def monitors(self) -> Monitors:
        """What watches the run."""
        ...

    @property
    def state(self) -> TrainState:
        """What training changes."""
        ...

    @property
    def result(self) -> FitResult:
        """The result so far."""
        ...

    @property
    def callbacks(self) -> CallbackList:
        """Every callback."""
        ...

    @property
    def phases(self) -> PhaseAnnouncer:
        """Tells the callbacks which phase begins."""
        ...

    @property
    def view(self) -> RunView | None:
        """The read-only view callbacks are given (None before it is made)."""
        ...

    def request_stop(self, reason: str) -> None:
        """Ask the run to stop after the current step."""
        ...
