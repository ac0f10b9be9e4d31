"""DataLoader helpers: seeding worker processes and choosing how many to start."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` that seeds NumPy and ``random`` in a DataLoader worker.

    Each worker's ``torch.initial_seed()`` is the loader's base seed plus the worker id, so
    seeding from it gives every worker its own stream, and fixing the loader's
    ``generator`` fixes all three libraries. Recent torch versions seed NumPy and
    ``random`` in workers too (from the same base seed); this makes the rule explicit and
    independent of the torch version, so random augmentations never repeat across workers.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(list(range(8)), num_workers=0, worker_init_fn=seed_worker)
    """
    seed = torch.initial_seed()  # this worker's seed: base seed + worker_id
    np.random.seed(seed % 2**32)  # NumPy takes 32-bit seeds
    random.seed(seed)


def default_num_workers(device_type: str, local_world_size: int) -> int:
    """DataLoader workers per rank when the config leaves the choice to gpufleet.

    CPU training gets 0: the model's own compute already uses every core, and worker
    processes would only compete with it (the built-in memory-mapped data is cheap to read
    in the main process); other non-CUDA devices get 0 too. CUDA training gets
    ``min(4, max(1, cores_per_rank - 1))``: one core per rank is left for the training
    process that feeds the GPU, and more than 4 workers rarely helps while each costs
    memory and start-up time.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ... (``torch.device.type``).
        local_world_size: ranks on this machine, which share its cores.

    Example:
        >>> default_num_workers("cpu", 1)
        0
    """
    if not isinstance(local_world_size, int) or local_world_size < 1:
        raise ValueError(f"local_world_size = {local_world_size!r}: must be an integer >= 1 "
                         "(the number of ranks on this machine).")
    if device_type != "cuda":
        return 0
    cores_per_rank = (os.cpu_count() or 1) // local_world_size
    return min(4, max(1, cores_per_rank - 1))
