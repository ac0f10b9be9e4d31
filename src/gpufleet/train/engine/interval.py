"""One log interval: what the loop adds up between log lines, reduced across ranks once
at its end (:class:`LogInterval`).

Each step's loss is kept on the device by reference and the interval's are summed at
its end in one reduction (nothing per step waits for the GPU or adds a device
operation); samples and tokens are host counts from batch shapes. At the end of the interval one
all-reduce carries the loss, the gradient norm, the counts, the non-finite guard's
pending probes and every rank's phase times: the loop's only host-device sync.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpufleet.monitor.accounting import CLOCK, rank_accounting
from gpufleet.monitor.arrival import ARRIVAL
from gpufleet.monitor.metrics import (
    arrival_metrics,
    clock_metrics,
    flops_metrics,
    ops_metrics,
    phase_metrics,
)
from gpufleet.monitor.phases import PHASES
from gpufleet.train.engine.view import RunLike


class LogInterval:
    """The running sums of the current log interval.

    Args:
        run: the run whose loop adds to it.
    """

    def __init__(self, run: RunLike) -> None:
        self.run = run
        # Each optimizer step's summed loss (device tensors, by reference), added up at the
        # end of the interval: no device operation per step.
        self.losses: list[torch.Tensor] = []
        self.micro_steps = 0  # micro-batches whose loss is in losses
        self.grad_norm = torch.zeros((), device=run.device)  # the last step's, on device
        self.first_step = run.state.step  # the step done when the interval began
        self.start = time.perf_counter()
        # The step clock of the accounting: from one close to the next, evaluation and
        # checkpoints included (restart_clock leaves it alone).
        self.opened = self.start

    def add(self, loss: torch.Tensor, micro_steps: int) -> None:
        """An optimizer step's summed loss over its ``micro_steps`` micro-batches (one
        the guard skipped on the device is taken out again in :meth:`close`)."""
        self.losses.append(loss)
        self.micro_steps += micro_steps

    def restart_clock(self) -> None:
        """Time from now on (evaluation and checkpoints are not training time)."""
        self.start = time.perf_counter()

    def close(self) -> dict[str, Any]:
        """End the interval: reduce across ranks (COLLECTIVE + SYNC), add to the run's
        totals, start the next interval, and return the metrics of the log line."""
        run, state = self.run, self.run.state
        now = time.perf_counter()
        seconds, wall, self.opened = now - self.start, now - self.opened, now
        world, guard, timer = run.env.world_size, run.nonfinite, run.monitors.phase_timer
        samples, tokens = run.counts.take_counts()
        # On the device: the loss sum, the last gradient norm, the guard's flags and your
        # step's values; on the host: the counts and this rank's phase times.
        # The losses as one float32 vector (a copy; bf16 and fp16 losses convert exactly),
        # summed in one reduction.
        loss_sum = (torch.stack(self.losses).float().sum() if self.losses
                    else torch.zeros((), device=run.device))
        parts = [torch.stack([loss_sum, self.grad_norm.float().to(run.device)])]
        skips = guard.pending() if guard is not None else None  # on the device path
        if skips is not None:  # the same on every rank: the sum is world times it
            parts.append(skips)
        # Your training step's values: each one's sum and count (the same keys, in the
        # same order, on every rank).
        logged = run.user_step.take_logged() if run.user_step is not None else {}
        keys = sorted(logged)
        if keys:
            parts.append(torch.stack([v for k in keys for v in (
                logged[k][0].to(run.device), torch.tensor(float(logged[k][1]),
                                                           device=run.device))]))
        host = [float(samples), float(tokens)]
        # Every rank fills its own row of a [world, phases] table (and of the all-reduce
        # arrival table); the sum hands every rank the whole table (the straggler view).
        arrival = run.monitors.arrival
        clock = None  # the step accounting's clock row (with the phase times)
        if timer is not None:
            steps, outside = max(1, state.step - self.first_step), timer.take_outside()
            clock = [wall / steps, outside.get("eval", 0.0) / steps,
                     outside.get("checkpoint", 0.0) / steps]
        # The op clock's newest sample (CPU): each phase's time inside operators.
        op_clock = run.monitors.op_clock if timer is not None else None
        for row in (timer.take()[0] if timer is not None else None,
                    arrival.take() if arrival is not None else None, clock,
                    op_clock.take() if op_clock is not None else None):
            if row is not None:
                table = [0.0] * (world * len(row))
                table[run.env.rank * len(row):(run.env.rank + 1) * len(row)] = row
                host.extend(table)
        stats = parts[0] if len(parts) == 1 else torch.cat(parts)
        if run.strategy.reduces():
            stats = torch.cat([stats, torch.tensor(host, dtype=torch.float32,
                                                   device=run.device)])
            # COLLECTIVE + SYNC, once per log interval: mean loss over ranks and
            # micro-steps, the exact global sample and token counts, and every rank's
            # phase times.
            run.strategy.all_reduce(stats)
            values = stats.tolist()
        else:  # one process: nothing to reduce, the host values stay on the host
            values = stats.tolist() + host  # SYNC, once per log interval
        loss_total, norm_total, *rest = values
        micro_steps = self.micro_steps
        if skips is not None and guard is not None:  # skips come from the guard
            loss_total = guard.settle([v / world for v in rest[:len(skips)]],
                                      self.first_step, run.env.is_main, loss_total)
            # The skipped steps' losses are out of loss_total: out of the count too.
            micro_steps -= guard.interval_skipped * run.cfg.optim.grad_accum
            rest = rest[len(skips):]
        named, rest = rest[:2 * len(keys)], rest[2 * len(keys):]
        samples, tokens, *rest = rest
        # Pipeline stages read the same samples: count each once.
        copies = run.counts.data_copies
        samples, tokens = samples / copies, tokens / copies
        state.train_time_s += seconds
        state.samples += samples
        state.tokens += tokens
        # Skipped steps add no loss; an interval of skipped steps only has none.
        loss = loss_total / (micro_steps * world) if micro_steps else float("nan")
        metrics: dict[str, Any] = {
            "step": state.step, "epoch": run.counts.epoch, "loss": loss,
            "lr": learning_rate(run.optimizer),
            "samples_per_s": samples / seconds if seconds > 0 else 0.0,
            "step_time_s": seconds / max(1, state.step - self.first_step),
        }
        if run.cfg.optim.clip_norm:  # measured by the clip; nothing measures it otherwise
            metrics["grad_norm"] = norm_total / world
        for i, key in enumerate(keys):  # never in place of the run's own metrics
            metrics.setdefault(key, named[2 * i] / named[2 * i + 1])
        skipped = sum(p.guard.interval_skipped for p in run.parts if p.guard is not None)
        if skipped:
            metrics["skipped_steps"] = skipped  # the same on all ranks
            for part in run.parts:
                if part.guard is not None:
                    part.guard.interval_skipped = 0
        if tokens:
            metrics["tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
        if timer is not None:
            metrics.update(phase_metrics(rest, world, run.env.rank, timer.device_times()))
            rest = rest[world * len(PHASES):]
        if arrival is not None:
            metrics["rank_arrival"] = arrival_metrics(rest, world)
            rest = rest[world * len(ARRIVAL):]
        if timer is not None:  # every part of every rank's step, and the residual
            clocks, rest = clock_metrics(rest, world), rest[world * len(CLOCK):]
            metrics["rank_accounting"] = rank_accounting(
                metrics["rank_phases"], metrics.get("rank_arrival"), clocks,
                ops_metrics(rest, world) if op_clock is not None else None)
        if run.device.type == "cuda":  # the allocator's own counter: no sync
            metrics["mem_peak_gb"] = torch.cuda.max_memory_reserved(run.device) / 2**30
        if state.flops_per_step and seconds > 0:
            metrics.update(flops_metrics(state.flops_per_step, metrics["step_time_s"],
                                         run.peak_flops))
        self.losses = []
        self.micro_steps = 0
        self.first_step = state.step
        self.restart_clock()
        return metrics


def learning_rate(optimizer: torch.optim.Optimizer | None) -> float:
    """The learning rate the optimizer's first parameter group steps with now (what a
    scheduler's ``get_last_lr()[0]`` reports after its step; 0.0 without an
    optimizer)."""
    return 0.0 if optimizer is None else float(optimizer.param_groups[0]["lr"])
