"""The process group: join it, leave it, and the few collectives every run needs.

Every helper here also works in a plain single process (no process group): collectives
become no-ops, so library code can call them without checking who launched it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpufleet.core.collectives import is_initialized
from gpufleet.core.ring import RING
from gpufleet.errors import LaunchError, unknown_choice
from gpufleet.launch.env import DistEnv, export_for_torch
from gpufleet.launch.etcd_cluster import uses_etcd
from gpufleet.launch.netif import choose_socket_ifname

logger = logging.getLogger(__name__)

# How to install Horovod (a plain pip install does not build for this torch).
HOROVOD_INSTALL = ("bash scripts/install-horovod.sh from gpufleet's source tree, which builds "
                   "Horovod against this torch (plain `pip install horovod` fails to compile "
                   "for torch >= 2.1); set HOROVOD_GPU_OPERATIONS=NCCL first on GPU machines")

def init_process_group(env: DistEnv, backend: str, init_method: str = "env://",
                       timeout_s: float = 600.0) -> None:
    """Join the job's process group as ``env.rank`` of ``env.world_size``.

    Does nothing when a process group already exists. With NCCL the rank first selects
    its GPU (``env.local_rank``) so that NCCL's communicators land on the right device.
    Ranks that ``horovodrun`` or ``mpirun`` started without ``MASTER_PORT`` meet at a
    store that rank 0 opens on a free port, its address broadcast through Horovod.

    Args:
        env: This rank's place in the job (usually ``DistEnv.detect()``).
        backend: "gloo" (CPU) or "nccl" (CUDA), or any other backend torch knows.
        init_method: "env://" (MASTER_ADDR/MASTER_PORT), "tcp://host:port" or "file://...".
        timeout_s: Seconds before the rendezvous, or later any collective, gives up.

    Raises:
        LaunchError: the backend is unknown or unusable here, or the ranks did not meet
            within ``timeout_s`` (the message names the address tried and the usual fixes).

    Example:
        >>> init_process_group(DistEnv.detect(), "gloo")  # doctest: +SKIP
    """
    if is_initialized():
        return
    if not dist.is_available():
        raise LaunchError("This torch build has no torch.distributed. Install a torch build "
                          "with distributed support, or run a single process (--nproc 1).")
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    for name in backend.split(","):  # also "cpu:gloo,cuda:nccl"
        if name.rpartition(":")[2] not in known:
            raise LaunchError(unknown_choice("dist.backend", backend, known))
    if "nccl" in backend:
        if not torch.cuda.is_available():
            raise LaunchError(f"dist.backend = {backend!r} needs CUDA GPUs, but this machine has "
                              "none. Use --dist.backend gloo (or auto) on CPU.")
        # One visible GPU (e.g. SLURM --gpus-per-task=1) is device 0 whatever the rank.
        torch.cuda.set_device(0 if torch.cuda.device_count() == 1 else env.local_rank)
    store = None
    if init_method.startswith("env://") and env.master_port == 0 and env.source in (
            "horovod", "mpi"):
        store, env = _rendezvous_through_horovod(env, timeout_s)
    elif init_method.startswith("env://") and env.world_size > 1 and uses_etcd():
        # --rdzv-backend etcd: the group meets in the etcd cluster, not in a store that
        # rank 0 would host (which dies with rank 0's node), and so does everything that
        # uses the job's store, also after an in-process recovery.
        from gpufleet.launch.etcd_store import ranks_store  # deferred: python-etcd, slow

        store = ranks_store((env.master_addr, env.master_port), timeout_s)
    export_for_torch(env)
    if env.world_size > env.local_world_size and init_method.startswith("env://"):
        # Several nodes (torchrun, SLURM...): talk over the interface that reaches rank 0.
        choose_socket_ifname(env.master_addr, peers=env.nodes)
    where = (f"{env.master_addr}:{env.master_port}" if init_method.startswith("env://")
             else init_method)
    logger.debug("rank %d/%d: joining %s process group at %s", env.rank, env.world_size,
                 backend, where)
    try:
        # The timeout bounds the rendezvous here and every collective afterwards.
        dist.init_process_group(backend=backend, init_method=None if store else init_method,
                                store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError) as err:  # DistError, DistStoreError, timeouts
        raise LaunchError(
            f"Rank {env.rank} of {env.world_size} could not join the {backend} process group "
            f"at {where} within {timeout_s:g} s: {err}\n"
            f"Check that all {env.world_size} ranks were started, that every rank uses the "
            "same MASTER_ADDR/MASTER_PORT (--dist.master_addr/--dist.master_port), that a "
            "firewall lets the port through, and raise --dist.timeout if ranks start slowly."
        ) from err


def _rendezvous_through_horovod(env: DistEnv, timeout_s: float) -> tuple[Any, DistEnv]:
    """Agree on a ``TCPStore`` for ranks that ``horovodrun`` or ``mpirun`` started.

    Those launchers set no address for torch to meet at. Their ranks can already talk
    through Horovod, though: rank 0 opens a store on a free port and Horovod broadcasts
    its address, so nothing is guessed and no port can be taken in between.
    """
    timeout = timedelta(seconds=timeout_s)
    if env.world_size == 1:  # `mpirun -np 1`: nobody to meet
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
        return store, dataclasses.replace(env, master_addr="127.0.0.1", master_port=store.port)
    launcher = "horovodrun" if env.source == "horovod" else "mpirun"
    set_address = ("Set MASTER_ADDR (rank 0's host) and MASTER_PORT (a free port) for every "
                   f"rank, e.g. {launcher} -x MASTER_ADDR=node1 -x MASTER_PORT=29500 ...")
    try:
        import horovod.torch as hvd  # optional dependency
    except ImportError as err:
        raise LaunchError(
            f"This process is rank {env.rank} of {env.world_size} started by {launcher}, "
            f"which sets no address for torch.distributed to meet at. {set_address}, or "
            f"install Horovod ({HOROVOD_INSTALL}) so the ranks agree on one through it.") from err
    hvd.init()
    if (hvd.rank(), hvd.size()) != (env.rank, env.world_size):
        raise LaunchError(
            f"{launcher} started this process as rank {env.rank} of {env.world_size}, but "
            f"Horovod here sees rank {hvd.rank()} of {hvd.size()}: this launcher did not wire "
            "Horovod up (a Horovod built without MPI under mpirun, or one launcher inside "
            f"another), so the ranks cannot agree on an address through it. {set_address}, "
            "or start the job with horovodrun alone.")
    store, address = None, None
    if env.rank == 0:
        # One node: loopback. Several: this host's name, unless the user named one.
        host = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if hvd.local_size() == hvd.size() else socket.getfqdn())
        store = dist.TCPStore(host, 0, env.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        address = (host, store.port)
    # COLLECTIVE (Horovod's): rank 0's store address to every rank.
    host, port = hvd.broadcast_object(address, root_rank=0, name="gpufleet.rendezvous")
    if store is None:
        try:
            store = dist.TCPStore(host, port, env.world_size, is_master=False,
                                  timeout=timeout)
        except (RuntimeError, OSError) as err:
            raise LaunchError(
                f"Rank {env.rank} cannot reach rank 0's store at {host}:{port}: {err}. If "
                "that host name does not resolve from here, set MASTER_ADDR to an address "
                f"of rank 0's node that every node can reach ({launcher} -x MASTER_ADDR=...)."
            ) from err
    return store, dataclasses.replace(env, master_addr=host, master_port=port)


def destroy_process_group() -> None:
    """Leave the process group; does nothing when there is none.

    Example:
        >>> destroy_process_group()
    """
    if is_initialized():
        dist.destroy_process_group()


def job_store() -> Any:
    """The key-value store the process group was built on (a ``TCPStore`` on rank 0 for
    env:// and tcp://, the etcd cluster with ``--rdzv-backend etcd``), or None without a
    process group.

    Side channels that must work while a collective hangs (the watchdog's heartbeats)
    use it: the store answers from its own thread, whatever the ranks are doing.
    """
    if not is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # not exposed by this torch
        return None


def barrier(name: str | None = None) -> None:
    """Wait until every rank gets here; does nothing without a process group. ``name``
    labels it in the ring of collectives that hang reports show.

    Example:
        >>> barrier()
    """
    if is_initialized():
        n = RING.enter("barrier" if name is None else f"barrier {name!r}", 0)
        dist.barrier()  # collective: every rank must call it
        RING.leave(n)


def world_size() -> int:
    """Ranks in the job: the process group's size, else what the launcher's variables say.

    Example:
        >>> world_size()  # a plain process
        1
    """
    return dist.get_world_size() if is_initialized() else DistEnv.detect().world_size


def rank() -> int:
    """This process's global rank: from the process group, else the launcher's variables.

    Example:
        >>> rank()  # a plain process
        0
    """
    return dist.get_rank() if is_initialized() else DistEnv.detect().rank


@contextmanager
def rank_zero_first(local: bool = False) -> Iterator[None]:
    """Run the body on rank 0 first, then on the other ranks.

    For work whose result the others can reuse: downloads, preprocessing, caches. Rank 0
    (or, with ``local=True``, local rank 0 of every node, for caches on node-local disks)
    runs the body while the others wait at a barrier; then the others run it and find
    the cache. The barrier always spans the whole process group, so with ``local=True``
    the other ranks wait until the first rank of *every* node is done. Without a process
    group the body simply runs. If the first rank fails, the launcher stops the job.

    Example:
        >>> with rank_zero_first():
        ...     pass  # e.g. download the data set into the shared cache
    """
    if not is_initialized():
        yield
        return
    first = (DistEnv.detect().local_rank if local else dist.get_rank()) == 0
    if not first:
        barrier()  # wait for the first rank(s) to finish the body
    yield
    if first:
        barrier()  # let the others in
