"""What the loop needs to know about a batch: moving it, sizing it, getting a loss."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from gpufleet.errors import BatchError

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def make_loss_fn(loss: Callable[[Any, Any], torch.Tensor] | None = None) -> LossFn:
    """How the loop turns (model, batch) into a scalar loss.

    With ``loss`` given, a batch ``(inputs, target)`` gives ``loss(model(inputs), target)``,
    and a dict batch with ``labels`` (Transformers style) gives
    ``loss(model(**other_keys).logits, labels)``.
    Without it the model computes its own loss: a tuple batch is passed as
    ``model(*batch)``, a dict batch as ``model(**batch)`` (Transformers models), and the
    output must be a scalar tensor, or have ``.loss`` or ``["loss"]``.

    Example:
        >>> fn = make_loss_fn(torch.nn.functional.mse_loss)
        >>> m = torch.nn.Linear(2, 1)
        >>> fn(m, (torch.zeros(4, 2), torch.zeros(4, 1))).shape
        torch.Size([])
    """

    def compute(model: nn.Module, batch: Any) -> torch.Tensor:
        if loss is not None and type(batch) in (tuple, list) and len(batch) == 2:
            # The common (x, y), without _forward's tuple of what training drops.
            return _as_loss(loss(model(batch[0]), batch[1]), False)
        return _forward(model, batch, loss)[0]

    def with_output(model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any, Any]:
        """``(loss, output, target)``: what evaluation metrics need besides the loss."""
        value, out, target = _forward(model, batch, loss)
        if out is None and isinstance(batch, (tuple, list)) and len(batch) >= 2:
            # The model returned only its loss (e.g. GPT(idx, targets)): its output is
            # what it returns for the inputs alone. One more forward, evaluation only.
            out = _logits(model(*batch[:-1]))
        return value, out, target

    compute.with_output = with_output  # type: ignore[attr-defined]
    return compute


def _forward(model: nn.Module, batch: Any,
             loss: Callable[[Any, Any], torch.Tensor] | None) -> tuple[torch.Tensor, Any, Any]:
    """``(loss, output, target)`` of a batch; ``output`` is None when the model computed
    its own loss and returned nothing else."""
    if loss is not None:
        if type(batch) in (tuple, list) and len(batch) == 2:  # the common (x, y), first
            out, target = model(batch[0]), batch[1]
        elif isinstance(batch, Mapping) and "labels" in batch:  # logits + labels
            out = _logits(model(**{k: v for k, v in batch.items() if k != "labels"}))
            target = batch["labels"]
        elif not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise TypeError(f"with a loss function the batch must be (inputs, target); "
                            f"got {type(batch).__name__}. Return (x, y) from your dataset.")
        else:
            out, target = model(*batch[:-1]), batch[-1]
        return _as_loss(loss(out, target), False), out, target
    out = _call_with_batch(model, batch)
    target = batch.get("labels") if isinstance(batch, Mapping) else (
        batch[-1] if isinstance(batch, (tuple, list)) else None)
    logits = None if isinstance(out, torch.Tensor) else _logits(out, None)
    return _as_loss(out, isinstance(model, nn.DataParallel)), logits, target


_SAME = object()


def _logits(out: Any, default: Any = _SAME) -> Any:
    """The ``logits`` of a Transformers ModelOutput (or a plain dict); else ``default``
    (``out`` itself unless given)."""
    if isinstance(out, Mapping) and out.get("logits") is not None:
        return out["logits"]
    return out if default is _SAME else default


def _call_with_batch(model: nn.Module, batch: Any) -> Any:
    try:
        if isinstance(batch, Mapping):
            return model(**batch)
        if isinstance(batch, (tuple, list)):
            return model(*batch)
        return model(batch)
    except TypeError as e:
        if "argument" not in str(e):
            raise
        shape = f"dict with keys {list(batch)}" if isinstance(batch, Mapping) else (
            f"{type(batch).__name__} of {len(batch)} items"
            if isinstance(batch, (tuple, list)) else type(batch).__name__)
        raise BatchError(
            f"calling the model with the batch ({shape}) failed: {e}. With no loss function "
            "the model gets the whole batch and must return its loss. If it takes only the "
            "inputs, pass a loss function (loss_fn=... in Python, "
            "--model.loss=package.module:function on the CLI)."
        ) from e


def _as_loss(out: Any, data_parallel: bool) -> torch.Tensor:
    if type(out) is torch.Tensor and out.ndim == 0:
        return out  # the common case, decided without the checks below
    if isinstance(out, Mapping) and "loss" in out:
        out = out["loss"]
    elif not isinstance(out, torch.Tensor) and getattr(out, "loss", None) is not None:
        out = out.loss
    if not isinstance(out, torch.Tensor) or out.numel() == 0:
        raise TypeError(
            f"the model returned {type(out).__name__}, not a loss. Make forward return a "
            "scalar loss when given targets, return an object with .loss, or pass a loss "
            "function (loss_fn=... in Python, --model.loss=package.module:function on the CLI)."
        )
    if out.ndim == 1 and data_parallel:
        # nn.DataParallel gathers one loss per GPU; their mean is the batch loss.
        return out.mean()
    if out.ndim > 0:
        raise TypeError(
            f"the model returned a tensor of shape {tuple(out.shape)}, not a scalar loss. "
            "Reduce it in forward (e.g. .mean()), or pass a loss function."
        )
    return out
