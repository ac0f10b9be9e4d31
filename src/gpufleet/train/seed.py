"""Seeding and deterministic mode."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch on the CPU and on every CUDA device."""
    _seed(seed)


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def set_deterministic(enabled: bool) -> None:
    """Use only deterministic kernels; errors name any op that has none.

    cuBLAS needs a fixed workspace for deterministic matmuls, set before its first use.
    """
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def rng_state() -> dict[str, Any]:
    """Every RNG state of this process (saved per rank in checkpoints), as tensors and
    plain data only, so that a checkpoint loads with ``torch.load(weights_only=True)``:
    numpy's key array becomes an int64 tensor, Python's state stays ints in tuples."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos),
                  int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with python, numpy and torch drawing from ``seed``, then put this
    process's random state back as it was.

    The job the config names is built under it, so every rank builds the same initial
    weights, while the process itself is seeded once, per rank, by ``build_run``.

    Example:
        >>> with seeded(0):
        ...     a = torch.rand(1)
        >>> with seeded(0):
        ...     b = torch.rand(1)
        >>> bool(a == b)
        True
    """
    state = rng_state()
    _seed(seed)
    try:
        yield
    finally:
        set_rng_state(state)
