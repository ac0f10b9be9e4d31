"""Fabric's ``seed_everything(seed, workers=, verbose=)``, as ``gpufleet.seed_everything``
and the static ``Fleet.seed_everything``: the process seeded, and the DataLoader workers
of the loaders set up afterwards seeded per rank.

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
    >>> seed_everything(7, workers=True, verbose=False)
    7
"""

from __future__ import annotations

import functools
import logging
import os
import random
from typing import Any

import numpy as np
import torch

from gpufleet.train.seed import seed_everything as seed_all

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


#: The seeds numpy accepts, the bounds Fabric checks.
MIN_SEED, MAX_SEED = 0, 2**32 - 1
#: Fabric's variables: the seed chosen (read when none is given; ranks started later
#: inherit it) and whether loaders set up afterwards seed their workers.
SEED_VAR, WORKERS_VAR = "PL_GLOBAL_SEED", "PL_SEED_WORKERS"


def seed_everything(seed: int | None = None, workers: bool = False,
                    verbose: bool = True) -> int:
    """Seed python, numpy and torch in this process, as Lightning's
    ``seed_everything``: ``seed`` None reads ``PL_GLOBAL_SEED`` (0 when it is not set,
    with a warning); the seed is checked against numpy's bounds; it is written to
    ``PL_GLOBAL_SEED`` (processes started afterwards inherit it) and ``workers`` to
    ``PL_SEED_WORKERS`` (loaders set up afterwards then seed their workers per rank).
    Returns the seed.

    Raises:
        ValueError: the seed (given, or in ``PL_GLOBAL_SEED``) is not an integer from 0
            to 2**32 - 1.

    Example:
        >>> seed_everything(7, verbose=False)
        7
    """
    if seed is None:
        found = os.environ.get(SEED_VAR)
        if found is None:
            seed = 0
            if verbose:
                log.warning("seed_everything(None): no seed given and %s not set, seed "
                            "set to 0", SEED_VAR)
        else:
            try:
                seed = int(found)
            except ValueError:
                raise ValueError(f"{SEED_VAR}={found!r} is not an integer seed; set it to "
                                 f"a number from {MIN_SEED} to {MAX_SEED}, or unset it.") from None
    seed = int(seed)
    if not MIN_SEED <= seed <= MAX_SEED:
        raise ValueError(f"seed_everything({seed}): the seed must be from {MIN_SEED} to "
                         f"{MAX_SEED} (what numpy accepts).")
    if verbose:
        log.info("[rank: %s] seed set to %d", os.environ.get("RANK", "0"), seed)
    os.environ[SEED_VAR] = str(seed)
    os.environ[WORKERS_VAR] = str(int(bool(workers)))
    seed_all(seed)
    return seed


def seeds_workers() -> bool:
    """``seed_everything(workers=True)`` was called in this process (Fabric's flag)."""
    return os.environ.get(WORKERS_VAR, "0") not in ("", "0")


def chosen_seed(default: int) -> int:
    """The seed ``seed_everything`` chose (``PL_GLOBAL_SEED``), else ``default``: what
    Fabric's ``DistributedSampler`` takes when it shards a loader."""
    try:
        return int(os.environ[SEED_VAR])
    except (KeyError, ValueError):
        return default


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
