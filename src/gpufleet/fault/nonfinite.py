"""Agreeing, on every rank, to skip an optimizer step whose numbers went bad.

One rank whose loss turns NaN must not step while the others skip (their replicas would
drift apart), nor skip a collective the others enter (they would wait forever). So each
rank adds its loss and gradient norm into one number, the ranks all-reduce it (a sum is
finite only if every term is), and every rank acts on the same answer. That costs one
tiny collective and one host-device sync per step; ``fault.skip_nonfinite = false``
turns it off.

With fp16 loss scaling, gradients that overflow while the loss is finite are the
scaler's ordinary calibration: the step is skipped and the scale backed off on every
rank, without counting towards ``fault.max_skips_in_row`` until the scale has fallen
below 1 (a scale that low means the model itself produces inf, a collapse).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpufleet.config import FaultConfig
from gpufleet.errors import TrainingStopped
from gpufleet.launch import gather_objects

log = logging.getLogger(__name__)


@dataclass
class SkipRecord:
    """One skipped step, as every rank saw it."""

    step: int
    loss_ranks: list[int]  # ranks whose own loss was not finite
    grad_ranks: list[int]  # ranks whose gradients were not finite
    first_bad_param: str | None
    bad_params: int
    loss_scale: float | None = None


@dataclass
class NonFiniteGuard:
    """Decides, on all ranks alike, whether the current step is skipped.

    Args:
        cfg: the ``[fault]`` section.
        strategy: the run's strategy (its ``all_reduce`` and gradient norm).
        precision: the run's precision object (fp16 backs off its loss scale on a skip).
    """

    cfg: FaultConfig
    strategy: Any
    precision: Any
    skipped: int = 0
    in_row: int = 0
    interval_skipped: int = 0
    records: list[SkipRecord] = field(default_factory=list)

    def should_skip(self, model: nn.Module, step_loss: torch.Tensor,
                    grad_norm: torch.Tensor | None) -> bool:
        """Whether any rank's loss or gradients are non-finite for this step.

        ``grad_norm`` is the (unscaled) global norm when clipping computed it, else None
        and it is computed here.
        """
        if grad_norm is None:
            grad_norm = self.strategy.grad_norm(model)
        # One number carries both flags: loss + norm is finite only if both are, and a
        # sum over ranks is finite only if every rank's is (NaN and inf propagate).
        probe = step_loss.detach().float() + grad_norm.detach().float()
        self.strategy.all_reduce(probe)  # COLLECTIVE: every rank, every step
        if math.isfinite(probe.item()):  # SYNC: the step depends on the answer
            self.in_row = 0
            return False
        self._record(model, step_loss)
        return True

    def _record(self, model: nn.Module, step_loss: torch.Tensor) -> None:
        names = [n for n, p in self.strategy.unwrap(model).named_parameters()
                 if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        mine = (not bool(torch.isfinite(step_loss).all()), names[0] if names else None,
                len(names))
        # COLLECTIVE, on skipped steps only (every rank is here: the flags agreed).
        seen = gather_objects(mine)
        scale = self.precision.backoff() if hasattr(self.precision, "backoff") else None
        record = SkipRecord(
            step=0, loss_ranks=[r for r, s in enumerate(seen) if s[0]],
            grad_ranks=[r for r, s in enumerate(seen) if s[2]],
            first_bad_param=next((s[1] for s in seen if s[1]), None),
            bad_params=max(s[2] for s in seen), loss_scale=scale)
        self.skipped += 1
        self.interval_skipped += 1
        self.records.append(record)
        # fp16 gradients that overflow while every loss is finite: the scaler's ordinary
        # calibration, unless the scale has collapsed below 1.
        calibrating = scale is not None and not record.loss_ranks and scale >= 1.0
        if not calibrating:
            self.in_row += 1

    def report(self, step: int, is_main: bool) -> None:
        """Log the skip just recorded for optimizer step ``step``; stop the run when
        ``max_skips_in_row`` is reached."""
        record = self.records[-1]
        record.step = step
        what = describe(record)
        if self.in_row >= self.cfg.max_skips_in_row:
            raise TrainingStopped(
                f"{self.in_row} optimizer steps in a row were skipped for non-finite values "
                f"(last: step {step}: {what}). Lower optim.lr, set optim.clip_norm, use "
                "bf16-mixed instead of fp16-mixed, and check the data of those steps; "
                "resume from the last checkpoint with --resume latest.")
        if is_main:
            if record.loss_scale is not None and not record.loss_ranks \
                    and self.in_row == 0:
                log.info("step %d skipped by the fp16 loss scaler: %s", step, what)
            else:
                log.warning("step %d skipped on every rank: %s (%d skipped so far)",
                            step, what, self.skipped)


def describe(record: SkipRecord) -> str:
    """One line for a skipped step: which ranks, which parameter, the loss scale."""
    parts = []
    if record.loss_ranks:
        parts.append(f"non-finite loss on rank {_ranks(record.loss_ranks)}")
    if record.grad_ranks:
        parts.append(f"non-finite gradients on rank {_ranks(record.grad_ranks)} in "
                     f"{record.bad_params} parameter(s), first: {record.first_bad_param}")
    if record.loss_scale is not None:
        collapsed = " (collapsed: the model itself overflows fp16)" \
            if record.loss_scale < 1.0 else ""
        parts.append(f"fp16 loss scale now {record.loss_scale:g}{collapsed}")
    return "; ".join(parts) or "non-finite values"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
