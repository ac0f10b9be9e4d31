"""Your loop's own numbers and hooks: ``log``, ``log_dict``, ``call`` and the loggers of
:class:`~gpufleet.fleet.Fleet`, in Lightning Fabric's call forms.

A value your loop logs goes, on rank 0, to ``metrics.jsonl`` as a ``"user"`` line, to
the sinks of ``monitor.sinks`` (TensorBoard, MLflow, W&B), and to the loggers you gave
``Fleet(loggers=...)`` (Lightning's, or any object with ``log_metrics(metrics, step)``),
so a Fabric loop's loggers keep receiving what they did.
"""

from __future__ import annotations

import inspect
import numbers
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from gpufleet.errors import ConfigError
from gpufleet.fleet.part import FleetPart


def as_list(value: Any) -> list[Any]:
    """One object, a list or tuple of them, or None, as a list (Fabric's forms)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def as_loggers(loggers: Any) -> list[Any]:
    """``Fleet(loggers=)`` as a list (None: none), each able to take metrics.

    Raises:
        ConfigError: one has no ``log_metrics`` method.
    """
    found = as_list(loggers)
    for logger in found:
        if not callable(getattr(logger, "log_metrics", None)):
            raise ConfigError(
                f"Fleet(loggers=...): {type(logger).__name__} has no log_metrics(metrics, "
                "step) method. Give Lightning loggers, objects with that method, or use "
                "monitor.sinks (TensorBoard, MLflow, W&B) for gpufleet's own.")
    return found


class FleetLogs(FleetPart):
    """``log``, ``log_dict``, ``call``, ``logger`` and ``loggers`` of
    :class:`~gpufleet.fleet.Fleet` (a part of it)."""

    _user_callbacks: list[Any]
    _loggers: list[Any]
    _steps: Any  # the StepTracker

    @property
    def loggers(self) -> list[Any]:
        """The loggers given to ``Fleet(loggers=...)``."""
        return self._loggers

    @property
    def logger(self) -> Any:
        """The first of :attr:`loggers`, as Fabric's main logger."""
        if not self._loggers:
            raise ConfigError("fleet.logger: this Fleet has no loggers. Pass "
                              "Fleet(loggers=...), or log with fleet.log_dict (metrics.jsonl "
                              "and monitor.sinks).")
        return self._loggers[0]

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """:meth:`log_dict` of one value."""
        self.log_dict({name: value}, step)

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Numbers (or one-element tensors: read on the host, a SYNC) of rank 0 at
        ``step`` (default: the steps done): a ``"user"`` line in metrics.jsonl, the
        sinks (``monitor.sinks``) and your loggers' ``log_metrics``, under the names
        given; the loggers get the values and ``step`` as Fabric hands them (a
        tensor as its ``.item()``, the rest as given, ``step`` None when not given).
        Other ranks' calls do nothing, as with Fabric's loggers; reduce first
        (:meth:`all_reduce`) for a value over every rank."""
        run = self._rank_run()
        if self._steps.finished:
            raise ConfigError("fleet.log after fleet.finish(): the run's files are closed. "
                              "Log before finish (or before launch's function returns).")
        if not run.env.is_main:
            return
        given, values = {}, {}
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:  # Fabric's words: a loop's tests match them
                    raise ValueError(
                        f"log_dict: the metric {key!r} holds {value.numel()} values "
                        f"(shape {tuple(value.shape)}), so it cannot be converted to a "
                        "scalar. Log one number: reduce it first (value.mean()), or log "
                        "each element under its own name.")
                value = value.item()
            if not isinstance(value, numbers.Real):  # numpy's scalars and bools too
                raise ConfigError(f"log_dict: {key!r} is {type(value).__name__}: log "
                                  "numbers or one-element tensors.")
            given[key], values[str(key)] = value, float(value)
        self._steps.user_log(run.state.step if step is None else int(step), values)
        for logger in self._loggers:  # as Fabric hands them: the values and step as given
            logger.log_metrics(metrics=given, step=step)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call ``hook_name(*args, **kwargs)`` on each of your callbacks
        (``Fleet(callbacks=...)``) that has a method of that name, in their order, as
        Fabric's ``call``; the others are passed over. A method is given only the
        keyword arguments it names (all of them if it takes ``**kwargs``), as Fabric
        gives them."""
        for callback in self._user_callbacks:
            method = getattr(callback, hook_name, None)
            if method is None:
                continue
            if not callable(method):  # Fabric's warning (a UserWarning), in its words
                warnings.warn(f"Skipping the callback `{type(callback).__name__}."
                              f"{hook_name}` because it is not callable: fleet.call calls "
                              "methods only; rename the attribute, or make it a method.",
                              UserWarning, stacklevel=2)
                continue
            method(*args, **_accepted(method, kwargs))


def _accepted(method: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The items of ``kwargs`` that ``method`` names (all, where it takes ``**kw``)."""
    if not kwargs:
        return kwargs
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): pass them all
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}
