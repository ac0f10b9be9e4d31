"""What callbacks see of a run: a read-only view, not the trainer.

Every :class:`~gpufleet.core.callbacks.Callback` hook gets a :class:`RunView` as its
first argument. It reads the run's current values (``view.step`` is always the step
done so far) and refuses assignment, so a callback cannot change the run by accident.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from gpufleet.config import Config
    from gpufleet.launch import DistEnv
    from gpufleet.monitor.system import SystemSampler
    from gpufleet.train.engine.protocols import LearningRates, RunLike
    from gpufleet.train.engine.result import FitResult

# What a view reads, as paths into the run (gpufleet.train.engine.run.Run).
_FIELDS = {
    "step": "state.step", "flops_per_step": "state.flops_per_step",
    "epoch": "data.epoch", "epochs_done": "data.epochs_done",
    "pin_memory": "data.pin_memory", "system_sampler": "monitors.system_sampler",
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
        model: Any
        optimizer: Any
        scheduler: LearningRates
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
