"""Fabric's ``seed_everything(seed, workers=, verbose=)`` on a
:class:`~gpufleet.fleet.Fleet`: the process seeded, and the DataLoader workers of the
loaders set up afterwards seeded per rank.

Without a ``worker_init_fn`` a DataLoader seeds each worker's torch from a base seed
drawn from this process's random state, plus the worker's index (and, in recent torch,
``random`` and NumPy from the same). Ranks seeded alike draw the same base seed, so
worker ``k`` of every rank would draw the same random augmentations. With ``workers``
(Fabric's default), :func:`seed_rank_worker` mixes the rank in, as Lightning's
``pl_worker_init_function`` does, with the same numbers: a loop moved from Fabric gets
the same draws in its workers.

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
    the loader's base seed, the worker's index and the rank: the seeds Lightning's
    ``pl_worker_init_function(worker_id, rank)`` gives (its algorithm, Apache-2.0)."""
    base_seed = torch.initial_seed() - worker_id  # the DataLoader adds the worker's index
    seeds = _seed_sequence(base_seed, worker_id, rank, count=4)
    torch.manual_seed(seeds[0])
    random.seed((seeds[1] << 32) | seeds[2])
    np.random.seed(np.random.SeedSequence([base_seed, worker_id, rank]).generate_state(4))


def _seed_sequence(base_seed: int, worker_id: int, rank: int, count: int) -> list[int]:
    """``count`` 64-bit seeds from the three numbers: MurmurHash3's finalizer, then a
    linear congruential generator (Lightning's ``_generate_seed_sequence``)."""
    mixed = (base_seed << 32) | (worker_id << 16) | rank
    mixed ^= mixed >> 33
    mixed = (mixed * 0xFF51AFD7ED558CCD) & _MASK64
    mixed ^= mixed >> 33
    mixed = (mixed * 0xC4CEB9FE1A85EC53) & _MASK64
    mixed ^= mixed >> 33
    seeds = []
    for _ in range(count):
        mixed = (mixed * 6364136223846793005 + 1) & _MASK64
        seeds.append(mixed)
    return seeds


def add_worker_seeding(loader: Any, rank: int) -> None:
    """Give ``loader`` :func:`seed_rank_worker` for ``rank`` unless it has a
    ``worker_init_fn`` of its own (which is then left as it is, as Fabric leaves it)."""
    if getattr(loader, "worker_init_fn", False) is None:
        loader.worker_init_fn = functools.partial(seed_rank_worker, rank=rank)
