"""What a finished run reports: :class:`FitResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FitResult:
    """What a finished run reports (the same on every rank).

    Attributes:
        steps: optimizer steps done in total (resumed runs count the earlier ones).
        losses: ``(step, mean training loss over the log interval)`` pairs.
        eval_losses: ``(step, evaluation loss)`` pairs.
        samples_per_s / tokens_per_s: global throughput over training time (evaluation
            and checkpoint time excluded); tokens only for integer-id inputs.
        train_time_s: seconds spent in training steps this session.
        run_dir / checkpoint: where the run and its last written checkpoint are.
        epochs: passes over the training set (1.5: halfway through the second).
        skipped_steps: optimizer steps skipped for non-finite loss or gradients.
        checkpoint_errors: checkpoint writes that failed (training went on).
        callback_errors: non-essential callbacks (metric sinks) that failed, by name,
            with their first error (training went on without them).
        eval_metrics: ``(step, {metric: value})`` of each evaluation (``eval.metrics``).
        findings: what limits the run (:class:`gpufleet.monitor.diagnose.Finding`).
        preempted: the signal that stopped the run early ("SIGTERM", ...), after a
            checkpoint of its last step; None when it ran to the end.
        stopped_early: why the run stopped before its end on request (early stopping,
            a callback's ``view.request_stop``); "" when it did not.
    """

    steps: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    samples_per_s: float = 0.0
    tokens_per_s: float | None = None
    train_time_s: float = 0.0
    run_dir: str = ""
    checkpoint: str | None = None
    skipped_steps: int = 0
    epochs: float = 0.0
    checkpoint_errors: list[str] = field(default_factory=list)
    callback_errors: dict[str, str] = field(default_factory=dict)
    eval_metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    findings: list[Any] = field(default_factory=list)
    preempted: str | None = None
    stopped_early: str = ""

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1][1] if self.losses else None

    @property
    def eval_loss(self) -> float | None:
        return self.eval_losses[-1][1] if self.eval_losses else None
