"""Facts about the host: its CPU, the cores this process may use, the torch build.

Every benchmark prints :func:`machine_summary` beside its numbers (through
:mod:`gpufleet.core.machine`)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), e.g. "AMD EPYC 7B13"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def usable_cores() -> int:
    """Cores this process may run on (its affinity), else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cores_per_rank(local_world_size: int) -> int:
    """This node's usable cores shared among its ``local_world_size`` ranks (at least 1)."""
    return max(1, usable_cores() // max(1, local_world_size))


def machine_summary() -> str:
    """One line: CPU model, cores, torch version and the GPU (or that there is none)."""
    import torch

    gpu = (f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
           f"{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no CUDA")
    return (f"{cpu_model()}, {usable_cores()} usable core(s) of {os.cpu_count()}, "
            f"torch {torch.__version__}, Python {platform.python_version()}, {gpu}")


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
