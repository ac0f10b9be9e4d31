"""Optional metric sinks: TensorBoard, MLflow and Weights & Biases (``monitor.sinks``).

``metrics.jsonl`` is always written; these send the same "train" and "eval" metrics to
the tools people already watch. Each is a non-essential callback: if the tool fails
mid-run (a lost tracking server), the error is reported and training goes on. A missing
package is found at build time, before training starts, with the ``pip install`` that
fixes it.

* ``tensorboard``: event files in ``<run_dir>/tensorboard`` (``tensorboard --logdir
  runs``); needs ``pip install tensorboard``.
* ``mlflow``: a run named after the run directory, in the experiment and at the tracking
  URI mlflow's own environment variables choose (``MLFLOW_TRACKING_URI``,
  ``MLFLOW_EXPERIMENT_NAME``); the config as parameters.
* ``wandb``: a run named after the run directory, in ``WANDB_PROJECT`` (default
  "gpufleet"), files under the run directory; the config as the run's config. Set
  ``WANDB_MODE=offline`` on machines without a login.

Metric names: ``train/<key>`` for each number of a log interval (loss, lr, grad_norm,
samples_per_s, ...), ``phases/<phase>_ms`` for rank 0's phase times, ``eval/loss``.

Example:
    >>> build_sinks("", "runs/x", {})
    []
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from gpufleet.errors import ConfigError, unknown_choice
from gpufleet.train.callbacks import Callback

log = logging.getLogger(__name__)

_SKIP = {"kind", "time", "step"}  # the step is the x axis, not a metric


def flatten_metrics(metrics: dict[str, Any], prefix: str = "train/") -> dict[str, float]:
    """The numbers of a metrics record under sink names (nested per-rank lists dropped).

    Example:
        >>> flatten_metrics({"step": 3, "loss": 2.5, "phases": {"data": 0.01}, "x": "a"})
        {'train/loss': 2.5, 'phases/data_ms': 10.0}
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in _SKIP or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[prefix + key] = float(value)
        elif key == "phases" and isinstance(value, dict):
            out.update({f"phases/{p}_ms": float(s) * 1000 for p, s in value.items()
                        if isinstance(s, (int, float))})
    return out


def flatten_config(cfg_dict: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": 0.1}``."""
    out: dict[str, Any] = {}
    for key, value in cfg_dict.items():
        if isinstance(value, dict):
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


class _Sink(Callback):
    """Shared shape: open on rank 0 at fit start, send each log and eval, close at the end."""

    essential = False

    def __init__(self, run_dir: str | Path, cfg_dict: dict[str, Any]) -> None:
        self.run_dir = Path(run_dir)
        self.cfg_dict = cfg_dict
        self.active = False

    def on_fit_start(self, trainer: Any) -> None:
        if getattr(getattr(trainer, "env", None), "is_main", True):
            self.open()
            self.active = True

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.active:
            self.send(flatten_metrics(metrics), step)

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.active and metrics.get("eval_loss") is not None:
            self.send({"eval/loss": float(metrics["eval_loss"])}, step)

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self.active:
            self.active = False
            self.close()

    def open(self) -> None:
        raise NotImplementedError

    def send(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardSink(_Sink):
    """Scalars to ``<run_dir>/tensorboard`` through ``torch.utils.tensorboard``."""

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        config = json.dumps(self.cfg_dict, indent=2, default=str)
        self.writer.add_text("config", "```\n" + config + "\n```")

    def send(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class MLflowSink(_Sink):
    """A run per training run; the config as parameters, the metrics by step."""

    def open(self) -> None:
        import mlflow

        self.mlflow = mlflow
        self.own_run = mlflow.active_run() is None  # inside the user's run: log into it
        if self.own_run:
            mlflow.start_run(run_name=self.run_dir.name)
        params = {k: str(v)[:500] for k, v in flatten_config(self.cfg_dict).items()}
        mlflow.log_params(params)

    def send(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in values.items()},
                                step=step)

    def close(self) -> None:
        if self.own_run:
            self.mlflow.end_run()


class WandbSink(_Sink):
    """A Weights & Biases run; the config as the run's config, the metrics by step."""

    def open(self) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "gpufleet"),
                              name=self.run_dir.name, dir=str(self.run_dir),
                              config=self.cfg_dict)

    def send(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


# name -> (class, the module that must import, the pip package that provides it)
SINKS: dict[str, tuple[type[_Sink], str, str]] = {
    "tensorboard": (TensorBoardSink, "torch.utils.tensorboard", "tensorboard"),
    "mlflow": (MLflowSink, "mlflow", "mlflow"),
    "wandb": (WandbSink, "wandb", "wandb"),
}


def build_sinks(spec: str, run_dir: str | Path, cfg_dict: dict[str, Any]) -> list[Callback]:
    """The sink callbacks that ``spec`` (``monitor.sinks``, comma-separated) names.

    Args:
        spec: e.g. ``"tensorboard,wandb"``; empty: none.
        run_dir: the run directory.
        cfg_dict: the resolved config as a nested dict (logged as the run's parameters).

    Raises:
        ConfigError: an unknown sink name (with the valid ones), or a sink whose package
            is not installed (with the ``pip install`` that fixes it).

    Example:
        >>> build_sinks("tensorbord", "runs/x", {})
        Traceback (most recent call last):
        ...
        gpufleet.errors.ConfigError: monitor.sinks: unknown value 'tensorbord'. Did you mean \
'tensorboard'? Valid: tensorboard, wandb, mlflow. Separate several with commas.
    """
    names = list(dict.fromkeys(n.strip().lower() for n in spec.split(",") if n.strip()))
    sinks: list[Callback] = []
    for name in names:
        if name not in SINKS:
            raise ConfigError(unknown_choice("monitor.sinks", name, SINKS,
                                             "Separate several with commas."))
        cls, module, package = SINKS[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(
                f"monitor.sinks = {spec!r}: the {name} sink needs the {package!r} package, "
                f"which is not installed here ({e}). Run `pip install {package}`, or "
                f"leave {name} out of monitor.sinks.") from e
        sinks.append(cls(run_dir, cfg_dict))
    return sinks
