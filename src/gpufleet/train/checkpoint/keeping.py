"""Which checkpoints outlive ``keep_last``: the best ``checkpoint.keep_best`` by a
monitored value, and when a run stops early on a metric that stopped improving.

The scores of the checkpoints written so far are kept in ``checkpoints/scores.json``
(step -> value), so a resumed run keeps ranking the same checkpoints.

Example:
    >>> best = Best("min", min_delta=0.0)
    >>> [best.improves(v) for v in (3.0, 2.0, 2.5)]
    [True, True, False]
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from gpufleet.core.callbacks import Callback
from gpufleet.errors import ConfigError
from gpufleet.files import atomic_write_text
from gpufleet.train.checkpoint.files import checkpoint_dir

log = logging.getLogger(__name__)

SCORES = "scores.json"


def monitored(name: str, metrics: dict[str, Any]) -> float | None:
    """The value ``name`` names in a log line's or an evaluation's metrics: ``loss``,
    ``eval_loss``, ``eval_<metric>`` (from ``eval_metrics``); None when absent there."""
    if name in metrics and isinstance(metrics[name], (int, float)):
        return float(metrics[name])
    if name.startswith("eval_") and isinstance(metrics.get("eval_metrics"), dict):
        value = metrics["eval_metrics"].get(name[len("eval_"):])
        return None if value is None else float(value)
    return None


class Best:
    """The best value seen so far, in ``mode`` (min or max) by at least ``min_delta``."""

    def __init__(self, mode: str, min_delta: float = 0.0) -> None:
        self.sign = 1.0 if mode == "min" else -1.0
        self.min_delta = min_delta
        self.value: float | None = None

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best by ``min_delta`` (and becomes the best)."""
        if not math.isfinite(value):
            return False
        if self.value is None or self.sign * (self.value - value) > self.min_delta:
            self.value = value
            return True
        return False


class BestCheckpoints:
    """The scores of a run's checkpoints, and the steps of the best ``k``."""

    def __init__(self, run_dir: Path, k: int, mode: str) -> None:
        self.path = checkpoint_dir(run_dir) / SCORES
        self.k, self.sign = k, (1.0 if mode == "min" else -1.0)
        self.scores: dict[int, float] = {}
        if self.path.is_file():
            self.scores = {int(s): v for s, v in json.loads(self.path.read_text()).items()}

    def record(self, step: int, score: float | None) -> None:
        if score is not None and math.isfinite(score):
            self.scores[step] = score
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(self.scores, indent=1))

    def keep(self) -> set[int]:
        """The steps of the best ``k`` checkpoints scored so far."""
        ranked = sorted(self.scores, key=lambda s: (self.sign * self.scores[s], -s))
        return set(ranked[:self.k])


class EarlyStopping(Callback):
    """Asks the run to stop when ``early_stop.metric`` has not improved for
    ``patience`` checks. The metrics are the same on every rank (reduced), so every
    rank asks at the same step; the run then ends with a checkpoint."""

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.best = cfg, Best(cfg.mode, cfg.min_delta)
        self.since = 0  # checks without an improvement
        self.seen = False

    def on_log(self, view: Any, step: int, metrics: dict[str, Any]) -> None:
        self._check(view, step, metrics)

    def on_eval(self, view: Any, step: int, metrics: dict[str, Any]) -> None:
        self._check(view, step, metrics)

    def on_fit_end(self, view: Any, result: Any) -> None:
        if not self.seen and view.env.is_main:
            log.warning("early_stop.metric = %r was never logged nor evaluated: nothing "
                        "was checked. Use eval_loss, eval_<metric> or loss.", self.cfg.metric)

    def _check(self, view: Any, step: int, metrics: dict[str, Any]) -> None:
        value = monitored(self.cfg.metric, metrics)
        if value is None:
            return
        self.seen = True
        if self.best.improves(value):
            self.since = 0
            return
        self.since += 1
        if self.since >= self.cfg.patience:
            view.request_stop(f"early stop: {self.cfg.metric} did not improve by more than "
                              f"{self.cfg.min_delta:g} in {self.since} checks (best "
                              f"{self.best.value:.6g}, now {value:.6g})")


def check_monitor(name: str, has_eval: bool) -> None:
    """Refuse a monitored eval value in a run without evaluation data."""
    if name.startswith("eval_") and not has_eval:
        raise ConfigError(f"{name!r} is monitored (checkpoint.keep_best or early_stop), and "
                          "this run has no evaluation data. Give eval data, or monitor a "
                          "training value such as loss.")
