"""Hugging Face Transformers models in gpufleet: new tokens, and training through the trainer.

* :func:`~gpufleet.hf.vocab.add_tokens` adds tokens to a tokenizer, resizes the model's
  input embeddings (and a tied or untied output layer) and initialises the new rows.
* :func:`~gpufleet.hf.models.extend_vocabulary` does the same from a model folder to
  a new folder (what ``gpufleet tokens add`` runs).
* :func:`~gpufleet.hf.models.pretrained` is a model factory for
  ``gpufleet train --model gpufleet.hf:pretrained``; :class:`~gpufleet.hf.data.TextDataset`
  tokenizes texts and pads batches, so any Transformers model trains without a loop.

Transformers is an optional extra (``pip install 'gpufleet[hf]'``). This package imports
only the standard library at the top; the names below load their modules on first use.

Example:
    >>> from gpufleet.hf import add_tokens  # doctest: +SKIP
    >>> add_tokens(model, tokenizer, ["[ENT_START]", "[ENT_END]"], special=True,
    ...            init=["mean:entity start", "mean:entity end"])  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

from gpufleet.errors import GpufleetError

INSTALL_HINT = "pip install 'gpufleet[hf]'"

# Public name -> module that defines it (imported on first access).
_LAZY = {
    "add_tokens": "gpufleet.hf.vocab",
    "AddTokensResult": "gpufleet.hf.vocab",
    "InitSpec": "gpufleet.hf.vocab",
    "VocabularyError": "gpufleet.hf.vocab",
    "extend_vocabulary": "gpufleet.hf.models",
    "load_pretrained": "gpufleet.hf.models",
    "pretrained": "gpufleet.hf.models",
    "save_together": "gpufleet.hf.models",
    "TextDataset": "gpufleet.hf.data",
    "pad_batch": "gpufleet.hf.data",
}

__all__ = ["INSTALL_HINT", "MissingExtraError", "require_transformers", *_LAZY]


class MissingExtraError(GpufleetError, ImportError):
    """An optional dependency that a feature needs is not installed."""


def require_transformers(feature: str = "this feature") -> Any:
    """Import and return ``transformers``, or raise a :class:`MissingExtraError` that says
    how to install it.

    Example:
        >>> transformers = require_transformers("gpufleet tokens")  # doctest: +SKIP
    """
    try:
        import transformers
    except ImportError as e:
        raise MissingExtraError(
            f"{feature} needs Hugging Face Transformers, which is not installed here "
            f"({e}). Install it with: {INSTALL_HINT}"
        ) from e
    return transformers


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpufleet.hf' has no attribute {name!r}")
