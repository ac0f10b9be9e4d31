"""Evaluation metrics (``eval.metrics``): built-ins by name and your own functions.

Each metric adds two numbers per evaluation batch, a sum and a count; the loop sums
them over batches and across ranks in the same all-reduce as the evaluation loss, so
the value is exact whatever the number of ranks (a metric over 1000 samples on 2 ranks
equals the single-process value over the same 1000 samples).

Built-ins:

* ``accuracy``: share of predictions ``output.argmax(-1)`` equal to the target, over
  every target position (classes ``[batch, classes]`` against ``[batch]``, tokens
  ``[batch, time, vocab]`` against ``[batch, time]``); targets of -100 (ignored, the
  Transformers and ``cross_entropy`` convention) are not counted.
* ``top5_accuracy``: the target among the 5 highest outputs.
* ``perplexity``: ``exp`` of the evaluation loss (for language models).

Your own: ``package.module:function``, called as ``function(output, target)`` with the
model's output (``logits`` of a Transformers output) and the batch's target. Return a
scalar (the batch's mean: weighted by the batch size) or ``(sum, count)`` tensors. It
runs your code, so it is read only from your own command line or config; serving and
exporting never call it.

Example:
    >>> [m.name for m in build_metrics("accuracy, perplexity")]
    ['accuracy', 'perplexity']
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpufleet.config.schema import BUILTIN_METRICS, check_names

IGNORE_INDEX = -100
MetricFn = Callable[[Any, Any], Any]


@dataclass
class EvalMetric:
    """A named metric: ``update`` gives a batch's ``(sum, count)``; ``from_loss`` metrics
    are computed from the reduced evaluation loss instead."""

    name: str
    update: MetricFn | None = None
    from_loss: Callable[[float], float] | None = None


def _correct(output: torch.Tensor, target: torch.Tensor, k: int) -> tuple[Any, Any]:
    if output.shape[:-1] != target.shape:
        raise ValueError(f"accuracy compares output[..., classes] with a target of the same "
                         f"leading shape; got output {tuple(output.shape)} and target "
                         f"{tuple(target.shape)}.")
    valid = target != IGNORE_INDEX
    top = output.topk(min(k, output.shape[-1]), dim=-1).indices
    hit = (top == target.unsqueeze(-1)).any(-1) & valid
    return hit.sum(), valid.sum()


def accuracy(output: torch.Tensor, target: torch.Tensor) -> tuple[Any, Any]:
    """(correct, counted) of the argmax of ``output`` against ``target``."""
    return _correct(output, target, 1)


def top5_accuracy(output: torch.Tensor, target: torch.Tensor) -> tuple[Any, Any]:
    """(hits, counted) of ``target`` among the 5 highest outputs."""
    return _correct(output, target, 5)


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


_IMPLEMENTED: dict[str, EvalMetric] = {
    "accuracy": EvalMetric("accuracy", accuracy),
    "top5_accuracy": EvalMetric("top5_accuracy", top5_accuracy),
    "perplexity": EvalMetric("perplexity", from_loss=_perplexity),
}
# The config names the built-ins (it checks names without importing this module).
BUILTINS: dict[str, EvalMetric] = {name: _IMPLEMENTED[name] for name in BUILTIN_METRICS}


def build_metrics(spec: str) -> list[EvalMetric]:
    """The metrics ``spec`` names (comma-separated built-ins and ``module:function``).

    Raises:
        ConfigError: an unknown name (with the valid ones) or a function that cannot be
            imported.

    Example:
        >>> build_metrics("acuracy")
        Traceback (most recent call last):
        ...
        gpufleet.errors.ConfigError: eval.metrics: unknown value 'acuracy'. Did you mean \
'accuracy'? Valid: accuracy, top5_accuracy, perplexity. Or name your own as \
package.module:function(output, target).
    """
    from gpufleet.job import import_object

    return [BUILTINS[name] if name in BUILTINS else
            EvalMetric(name.rsplit(":", 1)[1], import_object(name, "eval.metrics"))
            for name in check_names(spec)]


def batch_totals(metric: EvalMetric, output: Any, target: Any, n: int) -> tuple[Any, Any]:
    """``(sum, count)`` of one batch; a scalar result counts as the mean of ``n`` samples."""
    if metric.update is None:  # the evaluator calls this only for per-batch metrics
        raise TypeError(f"eval metric {metric.name!r} is computed from the loss, not per "
                        "batch")
    got = metric.update(output, target)
    if isinstance(got, (tuple, list)) and len(got) == 2:
        total, count = got
        return total, count
    if (isinstance(got, torch.Tensor) and got.numel() == 1) or isinstance(got, (int, float)):
        return got * n, n
    raise TypeError(f"eval metric {metric.name!r} returned {type(got).__name__}; return a "
                    "scalar (the batch's mean) or a (sum, count) pair.")


def final_values(metrics: list[EvalMetric], totals: list[float], loss: float) -> dict[str, float]:
    """Each metric's value from the reduced ``[sum, count]`` pairs (in ``metrics`` order,
    ``from_loss`` metrics have none) and the evaluation loss.

    Example:
        >>> final_values(build_metrics("accuracy,perplexity"), [3.0, 4.0], 0.0)
        {'accuracy': 0.75, 'perplexity': 1.0}
    """
    values, pairs = {}, iter(zip(totals[::2], totals[1::2]))
    for m in metrics:
        if m.from_loss is not None:
            values[m.name] = m.from_loss(loss)
        else:
            total, count = next(pairs)
            values[m.name] = total / count if count else float("nan")
    return values
