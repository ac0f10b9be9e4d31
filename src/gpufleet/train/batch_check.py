"""Names the field of a batch that cannot go through the model, in one line."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn


def _fields(batch: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(batch, Mapping):
        yield from ((f"batch[{key!r}]", value) for key, value in batch.items())
    elif isinstance(batch, (tuple, list)):
        names = ("inputs", "target") if len(batch) == 2 else ()
        for i, value in enumerate(batch):
            yield (f"batch[{i}] ({names[i]})" if names else f"batch[{i}]"), value
    else:
        yield "batch", batch


def explain_batch(model: nn.Module, batch: Any) -> str | None:
    """One sentence naming a field of ``batch`` the model cannot take, what it is, what
    was expected and the fix; None when every field looks right.

    Example:
        >>> m = torch.nn.Linear(2, 1)
        >>> explain_batch(m, (torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, 1)))[:27]
        'batch[0] (inputs) is a floa'
    """
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    expected = param.dtype if param is not None else torch.float32
    for name, value in _fields(batch):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.dtype != expected:
                return (f"{name} is a {str(value.dtype).removeprefix('torch.')} tensor; the "
                        f"model's parameters are {str(expected).removeprefix('torch.')}. "
                        f"Cast it in the dataset (numpy: .astype(numpy.float32); torch: "
                        f".to(torch.{str(expected).removeprefix('torch.')})).")
            continue
        items = list(value) if isinstance(value, (tuple, list)) else [value]
        if items and all(isinstance(item, str) for item in items):
            return (f"{name} holds strings ({items[0]!r}, ...); a tensor was expected. Map "
                    "string labels to integer ids in the dataset (e.g. "
                    "{name: i for i, name in enumerate(sorted(labels))}), or tokenize text.")
        if not isinstance(value, (tuple, list, Mapping)):
            return (f"{name} is a {type(value).__name__}; a tensor was expected. Return "
                    "tensors or numpy arrays from the dataset.")
    return None
