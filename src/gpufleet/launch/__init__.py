"""Start the ranks of a run, find out who we are, and join the process group.

Example:
    >>> from gpufleet.launch import DistEnv, launch
    >>> DistEnv.detect({}).world_size
    1
"""

from typing import TYPE_CHECKING, Any

from gpufleet.core.collectives import broadcast_object, gather_objects, is_initialized
from gpufleet.errors import LaunchError
from gpufleet.launch.env import DistEnv, export_for_torch
from gpufleet.launch.process_group import (
    barrier,
    destroy_process_group,
    init_process_group,
    job_store,
    rank,
    rank_zero_first,
    world_size,
)
from gpufleet.launch.rendezvous import LaunchPlan

if TYPE_CHECKING:
    from gpufleet.launch.launcher import free_port, launch

__all__ = [
    "DistEnv",
    "LaunchError",
    "LaunchPlan",
    "barrier",
    "broadcast_object",
    "destroy_process_group",
    "export_for_torch",
    "free_port",
    "gather_objects",
    "init_process_group",
    "is_initialized",
    "job_store",
    "launch",
    "rank",
    "rank_zero_first",
    "world_size",
]


def __getattr__(name: str) -> Any:
    # The launchers (torch's elastic agent) on first use: a rank never needs them.
    if name in ("launch", "free_port"):
        from gpufleet.launch.launcher import free_port, launch

        return {"launch": launch, "free_port": free_port}[name]
    raise AttributeError(f"module 'gpufleet.launch' has no attribute {name!r}")
