"""Walking a (nested) tuple, list, dict or dataclass of tensors: moving it, sizing it.

Example:
    >>> batch_size_of((torch.zeros(4, 3), torch.zeros(4)))
    4
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in a (nested) tuple, list, dict or dataclass; keep the
    rest. Containers keep their type, as torch's own ``pin_memory`` keeps it: a
    namedtuple stays one, a ``BatchEncoding`` or ``OrderedDict`` too (a mapping that
    cannot be copied becomes a dict).

    Example:
        >>> map_tensors({"x": torch.ones(2), "n": 3}, lambda t: t * 2)
        {'x': tensor([2., 2.]), 'n': 3}
        >>> from collections import namedtuple
        >>> map_tensors(namedtuple("Batch", "x y")(torch.ones(1), 0), lambda t: t * 2)
        Batch(x=tensor([2.]), y=0)
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(v, fn) for k, v in batch.items()}
        if type(batch) is dict:
            return mapped
        try:
            if isinstance(batch, MutableMapping):  # defaultdict, UserDict, BatchEncoding
                clone = copy.copy(batch)
                clone.update(mapped)
                return clone
            return type(batch)(mapped)
        except TypeError:
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{
            f.name: map_tensors(getattr(batch, f.name), fn)
            for f in dataclasses.fields(batch) if f.init})
    return batch


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) tuple, list or dict to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        batch = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    if isinstance(batch, (tuple, list)):
        for v in batch:
            t = first_tensor(v)
            if t is not None:
                return t
    return None


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (no device sync)."""
    t = first_tensor(batch)
    return int(t.shape[0]) if t is not None and t.ndim > 0 else 1


def tokens_of(batch: Any) -> int | None:
    """Tokens in a batch when its inputs are integer ids of shape [batch, time]."""
    t = first_tensor(batch)
    if t is not None and t.ndim == 2 and not t.is_floating_point():
        return int(t.numel())
    return None
