"""Hugging Face ``datasets``: a ``Dataset`` or ``DatasetDict`` as gpufleet's training data.

A ``datasets.Dataset`` is already a map-style data set (``__len__``, ``__getitem__``) over
memory-mapped Arrow files, so it goes to the resumable sampler and the DataLoader as it
is: no rows are copied into Python lists, a forked loader worker shares the mapped pages,
and a pickled one (spawned ranks or workers) is re-opened from its files by path.

Two things are done here, without importing ``datasets`` (it stays optional):

- a ``DatasetDict`` is split into ``(train, eval)``: ``train``, and the first of
  ``validation``, ``eval``, ``test`` for evaluation;
- a ``Dataset`` with no format (rows of Python lists, which torch's default collation
  turns into a list per position) is given the ``torch`` format, so rows are tensors and
  ``{"input_ids": ..., "labels": ...}`` rows collate into one tensor per key. A format
  the user set (``set_format("torch")``, ``"numpy"``, columns) is kept.
"""

from __future__ import annotations

import logging
from typing import Any

from gpufleet.errors import ConfigError

log = logging.getLogger(__name__)

EVAL_SPLITS = ("validation", "eval", "test")  # the first one present is evaluated


def is_hf_dataset(obj: Any) -> bool:
    """True for a ``datasets.Dataset`` (by type, without importing ``datasets``)."""
    return any(c.__module__.startswith("datasets.") and c.__name__ == "Dataset"
               for c in type(obj).__mro__)


def is_hf_dataset_dict(obj: Any) -> bool:
    """True for a ``datasets.DatasetDict``."""
    return any(c.__module__.startswith("datasets.") and c.__name__ == "DatasetDict"
               for c in type(obj).__mro__)


def split_dataset_dict(splits: Any) -> tuple[Any, Any]:
    """``(train, eval)`` of a ``DatasetDict``; eval is None when it has no eval split.

    Example:
        >>> # train, eval = split_dataset_dict(load_from_disk("data/")) # {train, validation}
    """
    names = list(splits.keys())
    if "train" not in splits:
        raise ConfigError(f"the DatasetDict has splits {names} and no 'train'. Name the "
                          "training split 'train' (and the evaluation split one of "
                          f"{', '.join(EVAL_SPLITS)}), or pass the Datasets themselves.")
    eval_name = next((n for n in EVAL_SPLITS if n in splits), None)
    log.info("DatasetDict: training on 'train' (%d rows)%s", len(splits["train"]),
             f", evaluating on {eval_name!r} ({len(splits[eval_name])} rows)"
             if eval_name else ", no evaluation split")
    return splits["train"], splits[eval_name] if eval_name else None


def as_map_style(data: Any) -> Any:
    """``data``, with the ``torch`` format when it is a Hugging Face Dataset that has no
    format yet (a view: the Arrow table is shared, nothing is copied)."""
    if data is None or not is_hf_dataset(data):
        return data
    if data.format.get("type") is None:
        data = data.with_format("torch")
    return data


def hf_train_eval(train: Any, eval_data: Any) -> tuple[Any, Any]:
    """What :func:`gpufleet.fit` and data factories hand over, made ready to sample:
    a ``DatasetDict`` split, each Hugging Face ``Dataset`` given the torch format."""
    if is_hf_dataset_dict(train):
        if eval_data is not None:
            raise ConfigError("train_data is a DatasetDict and eval_data is also given. "
                              "Pass the DatasetDict alone (its validation split is "
                              "evaluated) or two Datasets.")
        train, eval_data = split_dataset_dict(train)
    return as_map_style(train), as_map_style(eval_data)
