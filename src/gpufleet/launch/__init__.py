"""Start the ranks of a run, find out who we are, and join the process group.

Example:
    >>> from gpufleet.launch import DistEnv, launch
    >>> DistEnv.detect({}).world_size
    1
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from gpufleet.errors import LaunchError

if TYPE_CHECKING:
    from gpufleet.core.collectives import broadcast_object, gather_objects, is_initialized
    from gpufleet.launch.env import DistEnv, export_for_torch
    from gpufleet.launch.launcher import free_port, launch
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

# Where each name lives. They are imported on first use (PEP 562), so that the modules of
# this package that need no torch (ssh, hosts, store, sbatch, etcd_cluster) load without
# it: `gpufleet --help`, `gpufleet train --bad-flag` and `gpufleet store` answer at once
# instead of after torch's seconds-long import. A rank imports them all as it starts.
_HOMES = {
    "broadcast_object": "gpufleet.core.collectives",
    "gather_objects": "gpufleet.core.collectives",
    "is_initialized": "gpufleet.core.collectives",
    "DistEnv": "gpufleet.launch.env",
    "export_for_torch": "gpufleet.launch.env",
    "free_port": "gpufleet.launch.launcher",
    "launch": "gpufleet.launch.launcher",
    "barrier": "gpufleet.launch.process_group",
    "destroy_process_group": "gpufleet.launch.process_group",
    "init_process_group": "gpufleet.launch.process_group",
    "job_store": "gpufleet.launch.process_group",
    "rank": "gpufleet.launch.process_group",
    "rank_zero_first": "gpufleet.launch.process_group",
    "world_size": "gpufleet.launch.process_group",
    "LaunchPlan": "gpufleet.launch.rendezvous",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'gpufleet.launch' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value  # once: later lookups find it here
    return value
