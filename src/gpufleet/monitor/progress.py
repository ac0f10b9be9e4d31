"""The live view of a run on rank 0: a rich view on a terminal, plain lines otherwise.

On a terminal (``bar``): a progress bar with the ETA, a line with the loss, learning
rate, throughput, data-wait share and MFU of the last log interval, and, when a
:class:`~gpufleet.monitor.system.SystemSampler` with GPUs is given, one row per GPU with
utilisation and memory bars, power and temperature (refreshed 4 times a second from the
sampler's newest sample, never from the training loop). Elsewhere (``lines``: CI, files):
one log line per log interval with the same numbers.

Example:
    >>> sample = {"gpus": [{"index": 0, "name": "NVIDIA H100", "util_pct": 87,
    ...            "mem_used_mb": 40960.0, "mem_total_mb": 81920.0}]}
    >>> gpu_summary(sample)
    'gpu util 87% | gpu mem 40.0/80.0 GB'
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from gpufleet.core.callbacks import Callback

log = logging.getLogger("gpufleet.progress")


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


def stats_text(metrics: dict[str, Any]) -> str:
    """One line of a log interval's numbers, e.g. ``loss 2.3010 | lr 3.00e-03 | ...``.

    Example:
        >>> stats_text({"loss": 2.301, "lr": 0.003, "samples_per_s": 1500.0,
        ...             "data_wait_share": 0.42})
        'loss 2.3010 | lr 3.00e-03 | 1.5k samples/s | data wait 42%'
    """
    rate = metrics.get("tokens_per_s")
    parts = [f"loss {metrics['loss']:.4f}", f"lr {metrics['lr']:.2e}",
             f"{_rate(rate)} tok/s" if rate else f"{_rate(metrics['samples_per_s'])} samples/s"]
    if metrics.get("data_wait_share") is not None:
        parts.append(f"data wait {metrics['data_wait_share']:.0%}")
    if metrics.get("mfu") is not None:
        parts.append(f"mfu {metrics['mfu']:.0%}")
    return " | ".join(parts)


def gpu_summary(sample: dict[str, Any] | None) -> str:
    """GPU utilisation (mean, and min when they differ) and the fullest GPU's memory."""
    gpus = [g for g in (sample or {}).get("gpus", []) if g.get("util_pct") is not None]
    if not gpus:
        return ""
    utils = [g["util_pct"] for g in gpus]
    text = f"gpu util {sum(utils) / len(utils):.0f}%"
    if len(utils) > 1 and min(utils) != max(utils):
        text += f" (min {min(utils):.0f}%)"
    mem = [g for g in gpus if g.get("mem_used_mb") is not None and g.get("mem_total_mb")]
    if mem:
        top = max(mem, key=lambda g: g["mem_used_mb"] / g["mem_total_mb"])
        text += f" | gpu mem {top['mem_used_mb'] / 1024:.1f}/{top['mem_total_mb'] / 1024:.1f} GB"
    return text


def gpu_table(sample: dict[str, Any] | None) -> Any:
    """A rich Table with a utilisation bar and a memory bar per GPU (None without GPUs)."""
    gpus = (sample or {}).get("gpus", [])
    if not gpus:
        return None
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    table = Table.grid(padding=(0, 1))
    for _ in range(7):
        table.add_column()
    for g in gpus:
        util, used, total = g.get("util_pct"), g.get("mem_used_mb"), g.get("mem_total_mb")
        mem_text = (f"{used / 1024:5.1f}/{total / 1024:.1f} GB"
                    if used is not None and total else "mem -")
        extra = " ".join(x for x in (
            f"{g['power_w']:.0f} W" if g.get("power_w") is not None else "",
            f"{g['temp_c']}°C" if g.get("temp_c") is not None else "") if x)
        table.add_row(
            f"[bold]GPU {g['index']}[/]", "util",
            ProgressBar(total=100, completed=util or 0, width=20),
            f"{util:3.0f}%" if util is not None else "  -",
            "mem", ProgressBar(total=total or 1, completed=used or 0, width=20),
            f"{mem_text} {extra}".rstrip())
    return table


class _Dashboard:
    """What the live view shows under the bar; rich renders it afresh at each refresh."""

    def __init__(self, view: Progress) -> None:
        self.view = view

    def __rich__(self) -> Any:
        from rich.console import Group

        sampler = self.view.sampler
        table = gpu_table(sampler.latest() if sampler is not None else None)
        parts = [self.view.stats] if self.view.stats else []
        return Group(*parts, *([table] if table is not None else []))


class Progress(Callback):
    """Shows step, loss, throughput, ETA, data-wait share and the GPUs.

    Args:
        mode: ``bar`` (a rich live view), ``lines`` (one log line per interval),
            ``off``, or ``auto`` (bar when the console is a terminal, else lines).
        sampler: a :class:`~gpufleet.monitor.system.SystemSampler` (anything with
            ``latest()``) for the GPU rows; None: the trainer's own SystemSampler
            callback if it has one, else no GPU rows.
        console: the rich Console of the live view (default: stderr).

    Example:
        >>> from io import StringIO
        >>> from rich.console import Console
        >>> Progress("auto", console=Console(file=StringIO())).mode  # not a terminal
        'lines'
    """

    def __init__(self, mode: str = "auto", sampler: Any = None, console: Any = None) -> None:
        if mode == "auto":
            terminal = console.is_terminal if console is not None else sys.stderr.isatty()
            mode = "bar" if terminal else "lines"
        self.mode = mode
        self.sampler = sampler
        self.console = console
        self.stats = ""
        self._bar = None
        self._live = None
        self._task = None
        self._start = 0.0

    def on_fit_start(self, trainer: Any) -> None:
        if not trainer.env.is_main or self.mode == "off":
            self.mode = "off"
            return
        self._start = time.perf_counter()
        self._first_step = trainer.step
        self._total = trainer.max_steps
        self._epochs = trainer.cfg.run.max_epochs
        if self.sampler is None:
            self.sampler = trainer.system_sampler
        if self.mode == "bar":
            self._start_live(trainer.step)

    def _start_live(self, step: int) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        console = self.console or Console(stderr=True)
        self._bar = RichProgress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console)
        self._task = self._bar.add_task("train", total=self._total, completed=step)
        self._live = Live(Group(self._bar, _Dashboard(self)), console=console,
                          refresh_per_second=4, transient=False)
        self._live.start()
        self._route_logging(to_bar=True)

    def on_step_end(self, trainer: Any, step: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step)

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        self.stats = stats_text(metrics)
        if hasattr(trainer, "epochs_done"):
            of = f"/{self._epochs}" if self._epochs else ""
            self.stats = f"epoch {trainer.epochs_done:.2f}{of} | {self.stats}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step)
            return
        done = step - self._first_step
        elapsed = time.perf_counter() - self._start
        eta = elapsed / done * (self._total - step) if done else 0.0
        gpus = gpu_summary(self.sampler.latest()) if self.sampler is not None else ""
        log.info("step %d/%d | %s%s | eta %ds", step, self._total, self.stats,
                 f" | {gpus}" if gpus else "", round(eta))

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        count = metrics.get("eval_samples")
        text = f"step {step}: eval loss {metrics['eval_loss']:.4f}" + "".join(
            f" | {name} {value:.4f}" for name, value in (metrics.get("eval_metrics") or
                                                         {}).items()) + (
            f" ({count} samples)" if count is not None else "")
        if self._live is not None:
            self._live.console.print(text)
        else:
            log.info(text)

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self._live is not None:
            self._route_logging(to_bar=False)
            self._live.stop()  # draws the final frame
            self._live = self._bar = None

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.on_fit_end(trainer, None)  # the traceback prints below the view, not in it

    def _route_logging(self, to_bar: bool) -> None:
        """While the view is live, rich swaps sys.stderr for a proxy that prints above
        it; log handlers opened earlier still hold the real stderr, so point them at the
        proxy (and back), or their lines would run into the view."""
        if to_bar:
            self._moved = [h for h in logging.getLogger().handlers
                           if isinstance(h, logging.StreamHandler)
                           and h.stream is sys.__stderr__]
        for handler in getattr(self, "_moved", []):
            handler.setStream(sys.stderr if to_bar else sys.__stderr__)
