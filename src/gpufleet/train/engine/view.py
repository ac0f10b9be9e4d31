"""What callbacks see of a run: a read-only view, not the trainer; and what the shared
parts read of a run (:class:`RunLike`).

Every :class:`~gpufleet.core.callbacks.Callback` hook gets a :class:`RunView` as its
first argument. It reads the run's current values (``view.step`` is always the step
done so far) and refuses assignment, so a callback cannot change the run by accident.

The view, the run's own callbacks (:func:`~gpufleet.train.engine.monitors.own_callbacks`),
the log interval (:class:`~gpufleet.train.engine.interval.LogInterval`) and the run's
end (:mod:`gpufleet.train.engine.step`) serve gpufleet's loop and your own loop through
:class:`~gpufleet.Fleet` alike, both on one :class:`~gpufleet.train.engine.run.Run`: the
Protocols here declare what they read of it (:class:`RunLike`), and the parts that
differ between the loops are declared by what they give (:class:`DataCounts`: the
built-in loop's stream, or the loaders your loop set up).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from gpufleet.config import Config
    from gpufleet.core.callbacks import CallbackList
    from gpufleet.core.phases import PhaseAnnouncer
    from gpufleet.launch import DistEnv
    from gpufleet.monitor.system import SystemSampler
    from gpufleet.train.engine.result import FitResult
    from gpufleet.train.engine.state import Monitors, TrainState
    from gpufleet.train.guard.nonfinite import NonFiniteGuard

class DataCounts(Protocol):
    """The data position and the sample and token counts of a run's training data:
    :class:`~gpufleet.train.engine.stream.TrainStream` in the built-in loop,
    :class:`~gpufleet.fleet.loader.SetUpLoaders` in your loop under Fleet."""

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


class GuardedPart(Protocol):
    """A model of the run with its non-finite guard (None when off)."""

    @property
    def guard(self) -> NonFiniteGuard | None:
        """Its non-finite guard."""
        ...


class LoggedValues(Protocol):
    """What the log interval reads of your training step: the values it logged."""

    def take_logged(self) -> dict[str, list[Any]]:
        """Each logged value's sum (a device tensor) and count since the last call."""
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
    def model(self) -> nn.Module | None:
        """The (primary) model as the strategy placed it (None before it is set up)."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The (primary) optimizer (None before it is set up); the log line reads its
        learning rate."""
        ...

    @property
    def scheduler(self) -> Any:
        """The (primary) LR scheduler, None where there is none (the view's)."""
        ...

    @property
    def counts(self) -> DataCounts:
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
    def user_step(self) -> LoggedValues | None:
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


# What a view reads, as paths into the run (a RunLike).
_FIELDS = {
    "step": "state.step", "flops_per_step": "state.flops_per_step",
    "epoch": "counts.epoch", "epochs_done": "counts.epochs_done",
    "pin_memory": "counts.pin_memory", "system_sampler": "monitors.system_sampler",
    **{name: name for name in ("max_steps", "cfg", "env", "run_dir", "device", "result",
                               "model", "optimizer", "scheduler", "strategy",
                               "precision")},
}


class RunView:
    """A read-only view of a run for callbacks.

    Attributes:
        step / epoch / epochs_done / max_steps: progress (steps done, the epoch being
            read, passes over the data as a float, the step the run ends at).
        cfg: the resolved :class:`~gpufleet.config.Config` (also ``config``).
        env: this rank's :class:`~gpufleet.launch.DistEnv` (``env.is_main``, ...).
        run_dir / device / pin_memory: where the run writes, this rank's device, and
            whether batches are pinned.
        result: the :class:`~gpufleet.train.engine.result.FitResult` so far.
        model / optimizer / scheduler / strategy / precision: the run's components
            (read them; the loop owns them).
        flops_per_step: counted on the second step (None before; 0 when not counted).
        system_sampler: this node's :class:`~gpufleet.monitor.system.SystemSampler`,
            or None on other ranks of the node and when off.
        phase: the phase the run is in (``"setup"`` before the first step).
        log_seconds: seconds each callback spent in ``on_log`` so far, by class name.
    """

    __slots__ = ("_run",)
    _run: RunLike

    if TYPE_CHECKING:  # properties made from _FIELDS below
        step: int
        flops_per_step: int | None
        epoch: int
        epochs_done: float
        pin_memory: bool
        system_sampler: SystemSampler | None
        max_steps: int
        cfg: Config
        env: DistEnv
        run_dir: Path
        device: torch.device
        result: FitResult
        model: nn.Module | None
        optimizer: torch.optim.Optimizer | None
        scheduler: Any
        strategy: Any
        precision: Any

    def __init__(self, run: RunLike) -> None:
        object.__setattr__(self, "_run", run)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a RunView is read-only (setting {name!r}); a callback "
                             "reports through its hooks and its own attributes.")

    @property
    def config(self) -> Config:
        return self._run.cfg

    @property
    def phase(self) -> str:
        current = self._run.phases.current
        return "setup" if current is None else str(current)

    def request_stop(self, reason: str = "") -> None:
        """Ask the run to stop: every rank stops after the same step (agreed with the
        preemption check, every ``fault.preempt_check_every`` steps), the run is
        evaluated and checkpointed as at its normal end, and ``reason`` is logged and
        kept in the result (``FitResult.stopped_early``)."""
        self._run.request_stop(reason)

    @property
    def log_seconds(self) -> dict[str, float]:
        return dict(self._run.callbacks.log_seconds)

    def __repr__(self) -> str:
        return f"RunView(step={self.step}, phase={self.phase!r}, run_dir={self.run_dir!r})"


for _name, _path in _FIELDS.items():
    setattr(RunView, _name, property(attrgetter(f"_run.{_path}")))
