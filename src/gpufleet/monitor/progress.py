"""The live view of a run on rank 0: a progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from gpufleet.train.callbacks import Callback

log = logging.getLogger("gpufleet.progress")


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


class Progress(Callback):
    """Shows step, loss, throughput and ETA.

    Args:
        mode: ``bar`` (a rich progress bar), ``lines`` (one log line per interval),
            ``off``, or ``auto`` (bar when stderr is a terminal, else lines).
    """

    def __init__(self, mode: str = "auto") -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode
        self._bar = None
        self._task = None
        self._start = 0.0

    def on_fit_start(self, trainer: Any) -> None:
        if not trainer.env.is_main or self.mode == "off":
            self.mode = "off"
            return
        self._start = time.perf_counter()
        self._first_step = trainer.step
        self._total = trainer.cfg.run.max_steps
        if self.mode == "bar":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                transient=False,
            )
            self._bar.start()
            self._route_logging(to_bar=True)
            self._task = self._bar.add_task("train", total=self._total,
                                            completed=trainer.step, stats="")

    def on_step_end(self, trainer: Any, step: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step)

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        rate = metrics.get("tokens_per_s")
        stats = (f"loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
                 + (f"{_rate(rate)} tok/s" if rate else
                    f"{_rate(metrics['samples_per_s'])} samples/s"))
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=stats)
            return
        done = step - self._first_step
        elapsed = time.perf_counter() - self._start
        eta = elapsed / done * (self._total - step) if done else 0.0
        log.info("step %d/%d | %s | eta %ds", step, self._total, stats, round(eta))

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        text = f"step {step}: eval loss {metrics['eval_loss']:.4f} " \
               f"({metrics['eval_samples']} samples)"
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            log.info(text)

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self._bar is not None:
            self._route_logging(to_bar=False)
            self._bar.stop()
            self._bar = None

    def _route_logging(self, to_bar: bool) -> None:
        """While the bar is live, rich swaps sys.stderr for a proxy that prints above the
        bar; log handlers opened earlier still hold the real stderr, so point them at the
        proxy (and back), or their lines would run into the bar."""
        if to_bar:
            self._moved = [h for h in logging.getLogger().handlers
                           if isinstance(h, logging.StreamHandler)
                           and h.stream is sys.__stderr__]
        for handler in getattr(self, "_moved", []):
            handler.setStream(sys.stderr if to_bar else sys.__stderr__)
