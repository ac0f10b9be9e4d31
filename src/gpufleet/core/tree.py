"""Walking a (nested) tuple, list, dict or dataclass of tensors: moving it, sizing it.

Example:
    >>> batch_size_of((torch.zeros(4, 3), torch.zeros(4)))
    4
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in a (nested) tuple, list, dict or dataclass, in new
    containers; keep the rest. Containers keep their type: a namedtuple stays one; a
    dict subclass (``OrderedDict``, ``Counter``, a Transformers ``ModelOutput``) or a
    ``UserDict`` (``BatchEncoding``) is a copy with its items set; a dataclass is a
    copy with its fields set (no ``__init__`` or ``__post_init__`` runs again); another
    mapping is rebuilt from a dict where its type takes one, else it becomes a dict.

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
        return _mapping_like(batch, {k: map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        items = [map_tensors(v, fn) for v in batch]
        try:
            return type(batch)(*items)
        except TypeError:  # a constructor of its own
            return tuple(items)
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        clone = copy.copy(batch)
        for f in dataclasses.fields(batch):
            object.__setattr__(clone, f.name, map_tensors(getattr(batch, f.name), fn))
        return clone
    return batch


def _mapping_like(original: Mapping, items: dict) -> Any:
    """``items`` in a mapping of ``original``'s type where that is safe (see
    :func:`map_tensors`); ``original`` is left as it was."""
    if type(original) is dict:
        return items
    try:
        if isinstance(original, (dict, UserDict)):  # a copy owns its items
            clone = copy.copy(original)
            for k, v in items.items():  # item by item: a Counter's update() adds
                clone[k] = v
            return clone
        if not isinstance(original, MutableMapping):
            # A Mapping's constructor is not part of Mapping; one taking no dict raises
            # TypeError, caught below.
            return type(original)(items)  # type: ignore[call-arg]
    except Exception:  # e.g. a mapping that refuses item assignment
        pass
    return items  # a mutable mapping of another kind: its copy may share its state


def each_tensor(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a (nested) tuple, list, dict or dataclass, in order, without
    building anything."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from each_tensor(v)
    elif isinstance(batch, (tuple, list)):
        for v in batch:
            yield from each_tensor(v)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from each_tensor(getattr(batch, f.name))


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) tuple, list or dict to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def first_tensor(batch: Any) -> torch.Tensor | None:
    return next(each_tensor(batch), None)


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
