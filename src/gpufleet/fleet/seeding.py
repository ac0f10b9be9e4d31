"""Fabric's ``seed_everything(seed, workers=, verbose=)`` on a
:class:`~gpufleet.fleet.Fleet`: the process seeded, and the DataLoader workers of the
loaders set up afterwards seeded per rank.

Without a ``worker_init_fn`` a DataLoader seeds each worker's torch from a base seed
drawn from this process's random state, plus the worker's index (and, in recent torch,
``random`` from the same). Ranks seeded alike draw the same base seed, so worker ``k``
of every rank would draw the same random augmentations. With ``workers`` (Fabric's
default), :func:`seed_rank_worker` mixes the rank in: every worker of every rank gets
its own torch, ``random`` and NumPy streams, derived with NumPy's ``SeedSequence`` from
the base seed, the worker's index and the rank. (Lightning derives them with a hash of
its own, so the draws inside the workers differ from a Fabric run's; what each rank's
workers draw apart, and the same run after run, is the same promise.)

Example:
    >>> seed_process(7, verbose=False, rank=0)
    7
"""

from __future__ import annotations

import functools
import logging
import random
from typing import Any

import numpy as np
import torch

from gpufleet.train.seed import seed_everything

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def seed_process(seed: int | None, verbose: bool, rank: int) -> int:
    """Seed python, numpy and torch with ``seed`` (None: 0, as Fabric when its
    ``PL_GLOBAL_SEED`` variable is not set, which Fleet does not read); returns it."""
    if seed is None:
        seed = 0
        if verbose:
            log.warning("seed_everything(None): no seed given, seed set to 0")
    seed = int(seed)
    seed_everything(seed)
    if verbose:
        log.info("[rank: %d] seed set to %d", rank, seed)
    return seed


def seed_rank_worker(worker_id: int, rank: int) -> None:
    """``worker_init_fn`` seeding torch, ``random`` and NumPy in a DataLoader worker from
    the loader's base seed, the worker's index and the rank (see the module docs)."""
    base_seed = torch.initial_seed() - worker_id  # the DataLoader adds the worker's index
    words = np.random.SeedSequence([base_seed & _MASK64, worker_id, rank]).generate_state(
        4, dtype=np.uint64)
    torch.manual_seed(int(words[0]))
    random.seed(int(words[1]))
    np.random.seed(words[2:].view(np.uint32))


def add_worker_seeding(loader: Any, rank: int) -> None:
    """Give ``loader`` :func:`seed_rank_worker` for ``rank`` unless it has a
    ``worker_init_fn`` of its own (which is then left as it is, as Fabric leaves it)."""
    if getattr(loader, "worker_init_fn", False) is None:
        loader.worker_init_fn = functools.partial(seed_rank_worker, rank=rank)
