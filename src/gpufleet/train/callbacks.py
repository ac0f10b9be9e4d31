"""Hooks where monitoring, checkpointing and displays attach to the loop.

Every method is a no-op by default. The hot path only calls :meth:`Callback.on_phase`
on callbacks that override it, so an unused hook costs nothing per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpufleet.train.loop import FitResult, Trainer


class Callback:
    """Subclass and override what you need. Runs on every rank; check
    ``trainer.env.is_main`` for things that should happen once."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """After setup (and resume), before the first step."""

    def on_phase(self, trainer: Trainer, phase: str) -> None:
        """A phase of the step begins: 'data', 'compute', 'optimizer' or 'end'.
        Called every micro-step; keep it to a clock read."""

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        """After optimizer step ``step`` (1-based count of steps done). No metrics here:
        reading them would force a host-device sync."""

    def on_log(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        """Every ``log.every`` steps, with metrics already reduced across ranks."""

    def on_eval(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        """After an evaluation, with exact cross-rank metrics."""

    def on_checkpoint(self, trainer: Trainer, step: int, path: str) -> None:
        """After a checkpoint was written."""

    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        """After the last step, the final evaluation and the final checkpoint."""


class CallbackList:
    """Dispatches each hook to the callbacks that override it, looked up once."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)
        for hook in _HOOKS:
            base = getattr(Callback, hook)
            owners = [c for c in self.callbacks if getattr(type(c), hook, base) is not base]
            setattr(self, hook, _dispatcher([getattr(c, hook) for c in owners]))
            if hook == "on_phase":
                # The loop calls these directly, with no dispatcher in between.
                self.phase_listeners = owners


_HOOKS = ("on_fit_start", "on_phase", "on_step_end", "on_log", "on_eval", "on_checkpoint",
          "on_fit_end")


def _dispatcher(listeners: list[Any]) -> Any:
    def call(*args: Any) -> None:
        for fn in listeners:
            fn(*args)

    return call
