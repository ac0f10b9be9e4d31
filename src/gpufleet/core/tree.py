"""Walking a (nested) tuple, list or dict of tensors: moving it, sizing it.

Example:
    >>> batch_size_of((torch.zeros(4, 3), torch.zeros(4)))
    4
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in a (nested) tuple, list or dict; keep the rest.

    Example:
        >>> map_tensors({"x": torch.ones(2), "n": 3}, lambda t: t * 2)
        {'x': tensor([2., 2.]), 'n': 3}
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) tuple, list or dict to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
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
