"""Optional metric sinks: TensorBoard, MLflow and Weights & Biases (``monitor.sinks``).

``metrics.jsonl`` is always written; these send the same "train" and "eval" metrics to
the tools people already watch. Each is a non-essential callback: if the tool fails
mid-run (a lost tracking server), the error is reported and training goes on. A missing
package is found at build time, before training starts, with the ``pip install`` that
fixes it.

* ``tensorboard``: event files in ``<run_dir>/tensorboard`` (``tensorboard --logdir
  runs``); needs ``pip install tensorboard``.
* ``mlflow``: a run named after the run directory, in the experiment
  ``MLFLOW_EXPERIMENT_NAME`` (default "gpufleet"); the config as parameters. The tracking
  store is ``MLFLOW_TRACKING_URI`` when set (a server, a database), else a SQLite file
  in the run directory, ``<run_dir>/mlflow/mlflow.db`` (``mlflow ui --backend-store-uri
  sqlite:///<run_dir>/mlflow/mlflow.db``): MLflow 3 refuses its old file store unless
  ``MLFLOW_ALLOW_FILE_STORE=true``. Inside a run the user started (``mlflow.start_run``),
  the metrics go into that run.
* ``wandb``: a run named after the run directory, in ``WANDB_PROJECT`` (default
  "gpufleet"), files under the run directory; the config as the run's config. Set
  ``WANDB_MODE=offline`` on machines without a login.

Metric names: ``train/<key>`` for each number of a log interval (loss, lr, grad_norm,
samples_per_s, ...), ``phases/<phase>_ms`` for rank 0's phase times, ``eval/loss`` and
``eval/<metric>`` (``eval.metrics``), what your own loop logs (``Fleet.log``) under
the names you gave, and ``system/<key>`` for the node's newest system
sample at each log interval (``system/cpu_pct``, ``system/ram_used_mb``,
``system/gpu<i>/util_pct``, ...; see :mod:`gpufleet.monitor.system`).

A sink that fails (cannot open, or loses its server) logs an ERROR, training goes on,
and the run's result and summary name it (``FitResult.callback_errors``).

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

from gpufleet.core.callbacks import Callback
from gpufleet.errors import ConfigError, unknown_choice

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


_SYSTEM_KEYS = ("ram_used_mb", "proc_rss_mb", "proc_cpu_pct", "disk_free_gb")
_GPU_KEYS = ("util_pct", "mem_used_mb", "power_w", "temp_c")


def flatten_system(sample: dict[str, Any] | None) -> dict[str, float]:
    """A system sample (:class:`~gpufleet.monitor.system.SystemSampler`) under sink names.

    Example:
        >>> flatten_system({"cpu_pct": [10.0, 30.0], "ram_used_mb": 900.0,
        ...                 "gpus": [{"index": 1, "util_pct": 87, "temp_c": None}]})
        {'system/cpu_pct': 20.0, 'system/ram_used_mb': 900.0, 'system/gpu1/util_pct': 87.0}
    """
    if not sample:
        return {}
    out: dict[str, float] = {}
    cores = sample.get("cpu_pct") or []
    if cores:
        out["system/cpu_pct"] = sum(cores) / len(cores)  # mean over the node's cores
    out.update({f"system/{k}": float(sample[k]) for k in _SYSTEM_KEYS
                if isinstance(sample.get(k), (int, float))})
    for gpu in sample.get("gpus", []):
        out.update({f"system/gpu{gpu['index']}/{k}": float(gpu[k]) for k in _GPU_KEYS
                    if isinstance(gpu.get(k), (int, float))})
    return out


def eval_values(metrics: dict[str, Any]) -> dict[str, float]:
    """An evaluation's numbers under sink names: ``eval/loss`` and ``eval/<metric>``.

    Example:
        >>> eval_values({"step": 4, "eval_loss": 0.5, "eval_samples": 64,
        ...              "eval_metrics": {"accuracy": 0.75}})
        {'eval/loss': 0.5, 'eval/accuracy': 0.75}
    """
    out = {"eval/loss": float(metrics["eval_loss"])} if metrics.get("eval_loss") is not None \
        else {}
    out.update({f"eval/{k}": float(v) for k, v in (metrics.get("eval_metrics") or {}).items()})
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
    name = "sink"  # how the summary names it when it fails

    def __init__(self, run_dir: str | Path, cfg_dict: dict[str, Any]) -> None:
        self.run_dir = Path(run_dir)
        self.cfg_dict = cfg_dict
        self.active = False
        self.sampler: Any = None

    def on_fit_start(self, trainer: Any) -> None:
        if getattr(getattr(trainer, "env", None), "is_main", True):
            self.sampler = getattr(trainer, "system_sampler", None)  # this node's sampler
            self.open()
            self.active = True

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.active:
            system = flatten_system(self.sampler.latest() if self.sampler else None)
            self.send({**flatten_metrics(metrics), **system}, step)

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        values = eval_values(metrics)
        if self.active and values:
            self.send(values, step)

    def on_user_log(self, trainer: Any, step: int, values: dict[str, float]) -> None:
        if self.active:
            self.send(values, step)

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self.active:
            self.active = False
            self.close()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        if self.active:  # what was sent stays; the run is marked as failed where it can be
            self.active = False
            self.close(failed=True)

    def open(self) -> None:
        raise NotImplementedError

    def send(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, failed: bool = False) -> None:
        """Flush and let go; ``failed``: the training run failed."""
        raise NotImplementedError


class TensorBoardSink(_Sink):
    """Scalars to ``<run_dir>/tensorboard`` through ``torch.utils.tensorboard``."""

    name = "tensorboard"

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        config = json.dumps(self.cfg_dict, indent=2, default=str)
        self.writer.add_text("config", "```\n" + config + "\n```")

    def send(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class MLflowSink(_Sink):
    """A run per training run; the config as parameters, the metrics by step.

    Talks to the store through an ``MlflowClient`` of its own, so the default SQLite
    store does not change the tracking URI of the user's own mlflow calls.
    """

    name = "mlflow"

    def open(self) -> None:
        import mlflow

        active = mlflow.active_run()
        self.own_run = active is None  # inside the user's run: log into it
        if active is not None:
            self.client = mlflow.MlflowClient(mlflow.get_tracking_uri())
            self.run_id = active.info.run_id
        else:
            self.client = mlflow.MlflowClient(self.tracking_uri())
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "gpufleet")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(name))
            self.run_id = self.client.create_run(
                experiment_id, run_name=self.run_dir.name).info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in flatten_config(self.cfg_dict).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        log.info("mlflow: run %s at %s", self.run_id, self.client.tracking_uri)

    def tracking_uri(self) -> str:
        """``MLFLOW_TRACKING_URI``, else a SQLite store in the run directory."""
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        folder = self.run_dir / "mlflow"
        folder.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(folder / 'mlflow.db').resolve()}"

    def send(self, values: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(k, v, now, step) for k, v in values.items()])

    def close(self, failed: bool = False) -> None:
        if self.own_run:
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class WandbSink(_Sink):
    """A Weights & Biases run; the config as the run's config, the metrics by step."""

    name = "wandb"

    def open(self) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "gpufleet"),
                              name=self.run_dir.name, dir=str(self.run_dir),
                              config=self.cfg_dict)

    def send(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


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
