"""Agreeing, on every rank, to skip an optimizer step whose numbers went bad.

One rank whose loss turns NaN must not step while the others skip (their replicas would
drift apart), nor skip a collective the others enter (they would wait forever). So each
rank flags a step whose loss or gradient norms are not finite, the ranks all-reduce the
flag (the maximum: flagged if any rank flagged it; no collective in a single process),
and every rank acts on the same answer.

The answer stays on the device. A fused optimizer (AdamW and SGD are built fused where
torch has the kernel) takes it as its ``found_inf`` flag, the way a loss scaler hands it
over: a flagged step leaves the weights, the moments and the step counter exactly as
they were. The flag costs two small operations per step: with clipping by norm the
clip's global norm (not finite exactly when some gradient is not) is checked with the
loss in one fused kernel, and the norm of each gradient the clip measured on the way is
kept for the culprit; without it, one number per gradient is taken here (the norms in
one fused kernel; on a CPU each gradient's sum). The flags, and on an interval with a skip
the norms and losses, are read once per log interval, folded into the loop's own
log-interval all-reduce: the skip count, the longest run of skips, the step and culprit
(rank, first bad parameter) of the first skip, and the loss sum without the skipped
steps. So the default configuration has no host sync per step;
``fault.max_skips_in_row`` is checked at the log interval.

Where the optimizer cannot take the flag (ZeRO, Horovod, an unfused optimizer) or the
loss scaler decides (fp16), one fused check of the loss and gradients is read on the
host every step; the culprit is looked for on a flagged step only. With fp16 loss
scaling, gradients that overflow while the loss is finite are the scaler's ordinary
calibration: the step is skipped and the scale backed off on every rank, not counting
towards ``fault.max_skips_in_row`` until the scale is below 1 (the model's own inf).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch import nn

from gpufleet.config import FaultConfig
from gpufleet.core.collectives import gather_objects
from gpufleet.errors import TrainingStopped
from gpufleet.parallel.grad_norm import (
    EachNorm,
    each_norm,
    each_norm_unstacked,
    local_piece,
    spreads_gradients,
)
from gpufleet.train.guard.nonfinite_optim import (
    dampened_momentum,
    norms_on,
    prime_momentum,
    takes_found_inf,
)
from gpufleet.train.guard.skips import SkipRecord, describe, record_of

log = logging.getLogger(__name__)


_SAID_HOST_PATH = False  # once a process: a recovery starts the guard again

# A step's record for the culprit: the norms a clip or each_norm measured, or on a CPU
# each gradient's bare sum, one 0-dim tensor per gradient (see _flag_gradients).
StepNumbers: TypeAlias = "EachNorm | Sequence[torch.Tensor]"


def _say_host_path(optimizer: Any, precision: Any) -> None:
    """Say once that the guard will read a number on the host every step, where a fused
    build of the user's optimizer would keep the decision on the GPU (as the optimizers
    gpufleet builds itself are). fp16's loss scaler reads its own flag every step as it
    is, and an optimizer without a fused kernel has no other way."""
    global _SAID_HOST_PATH
    defaults = getattr(optimizer, "defaults", {})
    if precision.scales_loss or "fused" not in defaults or defaults.get("fused") or \
            _SAID_HOST_PATH:
        return
    if dampened_momentum(optimizer):
        return  # fused, it would still decide on the host (see prime_momentum)
    _SAID_HOST_PATH = True
    log.info("non-finite guard: %s is not fused, so whether to skip a step is read on the "
             "host every step, a GPU sync per step. Build it with fused=True to decide on "
             "the GPU, or set fault.skip_nonfinite=false.", type(optimizer).__name__)


class _Interval:
    """What the device path keeps for each step of the log interval: the agreed flag
    (1.0: skipped) in a row of one device buffer (zeroed again after an interval with a
    skip), and by reference (no copies) one number per gradient (its norm, or on a CPU
    its sum: not finite where the gradient is not) and the loss. Read on the host at the
    log interval; the norms and losses only when a step was skipped."""

    def __init__(self, device: torch.device, rows: int = 16) -> None:
        self.rows = 0
        self.norms: list[StepNumbers] = []
        self.losses: list[torch.Tensor] = []
        self._buffer = torch.zeros(rows, device=device)
        self._flags = self._buffer.unbind()  # one view per row, made once
        self._capacity = rows

    def next_flag(self, each: StepNumbers, loss: torch.Tensor) -> torch.Tensor:
        """The zeroed flag of the next step, whose norms and loss are these."""
        row = self.rows
        if row == self._capacity:  # a longer interval than so far: double
            grown = torch.cat([self._buffer, torch.zeros_like(self._buffer)])
            self._buffer, self._flags, self._capacity = grown, grown.unbind(), 2 * row
        self.rows = row + 1
        self.norms.append(each)
        self.losses.append(loss)
        return self._flags[row]

    def drop_last(self) -> None:
        """Take back the last step's row (its flag zeroed again): that step is checked
        anew."""
        self.rows -= 1
        self._flags[self.rows].zero_()
        self.norms.pop()
        self.losses.pop()

    def flags(self) -> torch.Tensor:
        rows = self.rows
        return self._buffer if rows == self._capacity else self._buffer[:rows]

    def clear(self, flagged: bool) -> None:
        """Start the next interval; ``flagged``: some row was set (else every row is
        still zero). After an interval shorter than the buffer, the buffer takes its
        length (intervals are alike), so that :meth:`flags` needs no slice."""
        rows = self.rows
        if rows and rows != self._capacity:
            self._buffer = torch.zeros(rows, device=self._buffer.device)
            self._flags, self._capacity = self._buffer.unbind(), rows
        elif flagged:
            self._buffer.zero_()
        self.rows, self.norms, self.losses = 0, [], []


@dataclass
class NonFiniteGuard:
    """Decides, on all ranks alike, whether the current step is skipped.

    Args:
        cfg: the ``[fault]`` section.
        strategy: the run's strategy (its ``all_reduce`` and gradient norm).
        precision: the run's precision object (fp16 backs off its loss scale on a skip).
        clip_by_norm: the loop clips by global norm, and not by value, between
            :meth:`inspect` and :meth:`should_skip`: the clip's own measurement of every
            gradient (``strategy.measured``) is then the check, where the strategy
            measures it (every rank holds every gradient).
        device_path: False decides every step on the host (a run of several models,
            each with its own guard, whose log interval settles no device flags).
    """

    cfg: FaultConfig
    strategy: Any
    precision: Any
    clip_by_norm: bool = False
    device_path: bool = True
    skipped: int = 0
    in_row: int = 0
    interval_skipped: int = 0
    records: list[SkipRecord] = field(default_factory=list)
    on_device: bool | None = None  # decided at the first step (see takes_found_inf)
    _interval: _Interval | None = None
    _reuse_clip: bool = False
    _names: dict[int, str] = field(default_factory=dict)  # id(parameter) -> name
    _params: list[nn.Parameter] = field(default_factory=list)
    _sharded: bool = True  # some parameter is a DTensor (FSDP, tensor parallel)
    _sums: bool = False  # the record is each gradient's sum (on a CPU), not its norm
    _one: torch.Tensor | None = None
    _verdict: Any = False  # the host path's, from inspect() (False: not decided yet)
    _direct: bool = True  # the fused check takes the gradients as they are (see start)
    _agree: Any = None  # the strategy's all_reduce; None in a single process
    inspects: bool = True  #: set by start(): False where inspect() has nothing to do

    def inspect(self, model: nn.Module, step_loss: torch.Tensor,
                optimizer: torch.optim.Optimizer | None = None) -> None:
        """Right after backward (and unscaling), before any clipping changes the
        gradients: on the device path, flag the step and hand the flag to ``optimizer``
        (no host read), unless the clip measures the gradients next (see
        ``clip_by_norm``); on the host path, decide (:meth:`should_skip` answers).
        :attr:`inspects` says whether the loop calls this."""
        if self.on_device is None:
            self.start(model, optimizer, step_loss.device)
        if self.on_device and not self._reuse_clip:
            self._flag_gradients(step_loss, optimizer)
        elif not self.on_device:  # decided now, before a clip spreads a NaN into every
            self._verdict = self._host_verdict(step_loss)  # gradient: the culprit is read

    def forget_step(self) -> None:
        """The gradients :meth:`inspect` saw for this step changed before the optimizer
        stepped (your loop clipped, then ran backward again or dropped the batch): the
        next :meth:`inspect` looks at them anew, in place of the last one."""
        self._verdict = False
        interval = self._interval  # set by start() on the device path
        if self.on_device and self.inspects and interval is not None and interval.rows:
            interval.drop_last()

    def start(self, model: nn.Module, optimizer: Any, device: torch.device) -> None:
        """Choose the path for this run (the device path where ``optimizer`` takes the
        flag); the first :meth:`inspect` or :meth:`should_skip` calls it if the loop
        did not."""
        self.on_device = self.device_path and takes_found_inf(optimizer, self.precision)
        if not self.on_device and device.type == "cuda" and self.device_path:
            _say_host_path(optimizer, self.precision)
        named = list(self.strategy.unwrap(model).named_parameters())
        self._names = {id(p): n for n, p in named}
        self._params = [p for _, p in named if p.requires_grad]
        self._sharded = any(hasattr(p, "to_local") for p in self._params)  # DTensors
        self._sums = device.type == "cpu"
        # The fused check takes tensors on the loss's device, on CUDA not bf16 (its kernel
        # has none, pytorch#127176); otherwise it checks each one's float32 norm.
        self._direct = all(p.device == device and not (
            device.type == "cuda" and p.dtype == torch.bfloat16) for p in self._params)
        if self.on_device:
            prime_momentum(optimizer)
            self._one = torch.ones((), device=device)
            self._interval = _Interval(device)
            self._agree = self.strategy.all_reduce if self.strategy.reduces() else None
            self._reuse_clip = self.clip_by_norm and \
                not spreads_gradients(self.strategy.dims)
        # Only where the clip's norms are the check is there nothing to do before it.
        self.inspects = not (self.on_device and self._reuse_clip)

    def should_skip(self, model: nn.Module, step_loss: torch.Tensor,
                    grad_norm: torch.Tensor | None,
                    optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Whether the loop must skip this step on the host (call :meth:`inspect` first).

        On the device path (a fused ``optimizer``) the answer is always False: the
        optimizer received the agreed flag and skips by itself, and nothing is read on
        the host; ``grad_norm`` is the clip's global norm (None: no clip ran). Otherwise:
        whether any rank's loss or gradients, as backward left them, are not finite.
        """
        if self.on_device is None:
            self.start(model, optimizer, step_loss.device)
        if self.on_device:
            if self._reuse_clip:
                measured = self.strategy.measured if grad_norm is not None else None
                if measured is None:  # no clip ran: the gradients are as backward left them
                    measured = each_norm(self._params, step_loss.device)[0]
                # The global norm, when the clip gave it, is not finite exactly when some
                # gradient is not: one value to check instead of every norm.
                if grad_norm is None:  # each_norm's values: one stacked device vector
                    assert isinstance(measured.values, torch.Tensor)
                    grad_norm = measured.values
                self._flag_on_device(measured, [grad_norm, step_loss], step_loss, optimizer)
            return False
        verdict, self._verdict = self._verdict, False  # this step's, from inspect()
        if verdict is False:  # inspect() was not called: nothing was clipped since backward
            verdict = self._host_verdict(step_loss)
        if verdict is None:
            self.in_row = 0
            return False
        self._record(verdict)
        return True

    def _host_verdict(self, step_loss: torch.Tensor) -> tuple[bool, str | None, int] | None:
        """The host path's check: one fused kernel over the loss and this rank's
        gradients, agreed over the ranks and read here. None: no rank flagged the step;
        else this rank's view of it (:meth:`_record`)."""
        grads = [g for p in self._params if (g := p.grad) is not None]
        if self._sharded:
            grads = [local_piece(g) for g in grads]
        found = torch.zeros((), device=step_loss.device)
        if self._one is None:
            self._one = torch.ones((), device=step_loss.device)
        checked = [step_loss.detach().float(), *grads]
        torch._amp_foreach_non_finite_check_and_unscale_(  # (times one, in place)
            checked if self._direct else norms_on(checked, found.device), found, self._one)
        self.strategy.all_reduce(found)  # COLLECTIVE: every rank, every step
        if not found.item():  # SYNC: the step depends on the answer
            return None
        names = [self._names.get(id(p), "?") for p in self._params  # SYNC: flagged only
                 if (g := p.grad) is not None and not bool(local_piece(g).isfinite().all())]
        return not bool(torch.isfinite(step_loss).all()), names[0] if names else None, len(names)

    def _flag_gradients(self, step_loss: torch.Tensor, optimizer: Any) -> None:
        """:meth:`_flag_on_device` where no clip measured the gradients: one number per
        gradient (this rank's piece of it), kept by reference for the culprit, and one
        fused kernel that checks them with the loss. Every step: the fewest Python
        operations. The number is each gradient's norm (one fused kernel), or on a CPU,
        where every parameter is whole, its float32 sum: no launches to save there, and
        3-9 µs less a step (``benchmarks/guard_floor.py``). A sum is not finite exactly
        when an element is not, or past float32's range, which squares reach sooner."""
        params = self._params
        grads = [g for p in params if (g := p.grad) is not None]
        each: StepNumbers
        if self._sharded or len(grads) < len(params):
            each = each_norm_unstacked(params, self._sharded)
            checked = [*each.values, step_loss]
        elif self._sums:  # the bare values (_culprit knows the parameters)
            checked = [g.sum(dtype=torch.float32) for g in grads]
            each = tuple(checked)
            checked.append(step_loss)
        else:
            each = torch._foreach_norm(grads)
            checked = [*each, step_loss]
        self._flag_on_device(each, checked, step_loss, optimizer)

    def _flag_on_device(self, each: StepNumbers, checked: list[torch.Tensor],
                        step_loss: torch.Tensor, optimizer: Any) -> None:
        """Flag the step (1.0) where a value of ``checked`` (the loss and the gradients'
        numbers) is not finite, agreed over the ranks; the fused optimizer then changes
        nothing. ``each``: the step's record for the culprit. A few operations, no host
        read."""
        interval, one = self._interval, self._one
        assert interval is not None and one is not None, "start() sets the device path up"
        found = interval.next_flag(each, step_loss)
        # One fused kernel sets ``found`` where a value is not finite (it also multiplies
        # them by one, in place: no change).
        if not self._direct or step_loss.dtype == torch.bfloat16:
            checked = norms_on(checked, found.device)
        torch._amp_foreach_non_finite_check_and_unscale_(checked, found, one)
        if self._agree is not None:
            self._agree(found, "max")  # COLLECTIVE: every rank, every step; no SYNC
        optimizer.found_inf = found

    def pending(self) -> torch.Tensor | None:
        """The interval's agreed flags (1.0: the step was skipped), to fold into the
        log-interval all-reduce (None off the device path); every rank holds the same
        values."""
        interval = self._interval  # set by start() on the device path
        return interval.flags() if self.on_device and interval is not None else None

    def settle(self, flags: list[float], first_step: int, is_main: bool,
               loss_total: float) -> float:
        """Take the flags of the interval that began after optimizer step ``first_step``
        (:meth:`pending` as read on the host); report the first skip and stop the run
        after ``max_skips_in_row`` in a row. Returns ``loss_total`` (the loop's sum of
        every step's loss over the ranks) without the skipped steps' losses."""
        interval = self._interval
        assert interval is not None, "settle() takes what pending() gave on the device path"
        if not flags or max(flags) < 0.5:  # nothing skipped: the usual interval
            if flags:
                self.in_row = 0
            interval.clear(False)
            return loss_total
        skipped = [v >= 0.5 for v in flags]
        run = longest = self.in_row  # a run of skips goes on across intervals
        for bad in skipped:
            run = run + 1 if bad else 0
            longest = max(longest, run)
        count = sum(skipped)
        self.in_row = longest
        first = skipped.index(True)
        losses = torch.stack(interval.losses).float().tolist()  # SYNC (skips only)
        kept = math.fsum(v for v, bad in zip(losses, skipped) if not bad)
        mine = (*self._culprit(first, losses[first]), kept)
        seen = gather_objects(mine)  # COLLECTIVE: intervals with a skip only, all ranks
        loss_total = math.fsum(s[3] for s in seen)
        self.records.append(record_of([s[:3] for s in seen], None))
        self.skipped += count
        self.interval_skipped += count
        self.report(first_step + first + 1, is_main,
                    f" ({count} in this log interval)" if count > 1 else "")
        self.in_row = run
        interval.clear(True)
        return loss_total

    def _culprit(self, row: int, loss: float) -> tuple[bool, str | None, int]:
        """This rank's view of step ``row`` of the interval: its loss was not finite,
        the first parameter whose gradient was not, how many were not."""
        assert self._interval is not None, "only the device path keeps the norms"
        each = self._interval.norms[row]  # a gradient norm or sum: not finite where it is
        if not isinstance(each, EachNorm):  # every parameter's bare value (_flag_gradients)
            each = EachNorm(each, self._params, None)
        params = each.params if each.present is None else [each.params[i] for i in each.present]
        values = each.values
        if not isinstance(values, torch.Tensor):  # unstacked: the device path's every step
            values = torch.stack(list(values)) if values else torch.zeros(0)
        bad = [self._names.get(id(p), "?") for p, v in zip(params, values.tolist())
               if not math.isfinite(v)]
        return not math.isfinite(loss), bad[0] if bad else None, len(bad)

    def _record(self, mine: tuple[bool, str | None, int]) -> None:
        """Count a step skipped on the host; ``mine``: this rank's view of it (its loss
        was not finite, its first bad parameter, how many were bad)."""
        # COLLECTIVE, on skipped steps only (every rank is here: the flags agreed).
        seen = gather_objects(mine)
        scale = self.precision.backoff() if self.precision.scales_loss else None
        record = record_of(seen, scale)
        self.skipped += 1
        self.interval_skipped += 1
        self.records.append(record)
        # fp16 gradients that overflow while every loss is finite: the scaler's ordinary
        # calibration, unless the scale has collapsed below 1.
        calibrating = scale is not None and not record.loss_ranks and scale >= 1.0
        if not calibrating:
            self.in_row += 1

    def report(self, step: int, is_main: bool, more: str = "") -> None:
        """Log the skip just recorded for optimizer step ``step``; stop the run when
        ``max_skips_in_row`` is reached."""
        record = self.records[-1]
        record.step = step
        what = describe(record)
        if self.in_row >= self.cfg.max_skips_in_row:
            raise TrainingStopped(
                f"{self.in_row} optimizer steps in a row were skipped for non-finite values "
                f"(step {step}: {what}). Lower optim.lr, set optim.clip_norm, use "
                "bf16-mixed instead of fp16-mixed, and check the data of those steps; "
                "resume from the last checkpoint with --resume latest.")
        if is_main:
            if record.loss_scale is not None and not record.loss_ranks \
                    and self.in_row == 0:
                log.info("step %d skipped by the fp16 loss scaler: %s", step, what)
            else:
                log.warning("step %d skipped on every rank: %s%s (%d skipped so far)",
                            step, what, more, self.skipped)
