"""Who am I in the job? Read the rank layout that torchrun, SLURM, MPI or Horovod set.

Every launcher describes a rank through environment variables, each in its own words:
torchrun (and torch's elastic agent, and :func:`gpufleet.launch.launch`) sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``...; ``srun`` sets ``SLURM_PROCID``, ``SLURM_NTASKS``...;
``horovodrun`` sets ``HOROVOD_RANK``, ``HOROVOD_SIZE``...; ``mpirun`` sets
``OMPI_COMM_WORLD_RANK``... (Open MPI) or ``PMI_RANK``... (MPICH, Intel MPI).
:meth:`DistEnv.detect` turns any of them into one :class:`DistEnv`, and
:func:`export_for_torch` writes it back in torch's words so that ``init_method="env://"``
works under every launcher.

Horovod and MPI launchers name no rendezvous address for torch (their ranks meet through
their own channels): such a :class:`DistEnv` has ``master_port`` 0 unless the user set
``MASTER_ADDR``/``MASTER_PORT``, and :func:`gpufleet.launch.init_process_group` then
agrees on one through Horovod.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.errors import LaunchError, unknown_choice

logger = logging.getLogger(__name__)

SOURCES = ("none", "torchrun", "slurm", "horovod", "mpi")

# Step ids Slurm gives to steps that are not `srun` steps (slurm.h: SLURM_PENDING_STEP,
# SLURM_EXTERN_CONT, SLURM_BATCH_SCRIPT, SLURM_INTERACTIVE_STEP): a process in one of them
# is a script or a shell, not a rank.
_SLURM_SPECIAL_STEP_IDS = (0xFFFFFFFD, 0xFFFFFFFC, 0xFFFFFFFB, 0xFFFFFFFA)

# Steps of one job whose ports stay apart: step ids 0 .. _STEPS_PER_JOB - 1.
_STEPS_PER_JOB = 16


@dataclass(frozen=True)
class DistEnv:
    """The place of this process in the job, as its launcher described it.

    Attributes:
        rank: Global rank, 0 .. world_size - 1.
        local_rank: Rank on this node (the GPU index under one process per GPU).
        world_size: Number of ranks in the job.
        local_world_size: Number of ranks on this node.
        node_rank: Index of this node.
        master_addr: Host of rank 0's rendezvous store.
        master_port: Port of that store (0: not known yet, see the module docs).
        source: Who started this process: "none", "torchrun" (anything that sets
            RANK/WORLD_SIZE: torchrun, torch's elastic agent, our launchers), "slurm",
            "horovod" (``horovodrun``'s Gloo mode) or "mpi" (``mpirun``, also under
            ``horovodrun``'s MPI mode).
        restart_count: How many times the elastic agent restarted the ranks.
        nodes: The hosts of the job in node order, when the launcher names them (SLURM's
            step node list); empty otherwise.

    Example:
        >>> env = DistEnv.detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
        >>> env.rank, env.world_size, env.is_main, env.source
        (1, 2, False, 'torchrun')
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    source: str = "none"
    restart_count: int = 0
    nodes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise LaunchError(unknown_choice("DistEnv.source", self.source, SOURCES))
        if not (0 <= self.rank < self.world_size and 0 <= self.local_rank < self.local_world_size):
            raise LaunchError(
                f"Inconsistent rank layout from {self.source}: rank {self.rank} of "
                f"{self.world_size}, local rank {self.local_rank} of {self.local_world_size}. "
                "Check the RANK/WORLD_SIZE/LOCAL_RANK (or SLURM_*, HOROVOD_*, OMPI_COMM_WORLD_*, "
                "PMI_*) variables the launcher set."
            )

    @property
    def is_distributed(self) -> bool:
        """True when a launcher started this process as one rank of a job."""
        return self.world_size > 1 or self.source != "none"

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0 of each node."""
        return self.local_rank == 0

    @classmethod
    def detect(cls, environ: Mapping[str, str] = os.environ) -> DistEnv:
        """Read the rank layout from ``environ``: torchrun first, then SLURM, Horovod, MPI,
        else one process.

        Example:
            >>> DistEnv.detect({}).is_distributed
            False
            >>> env = DistEnv.detect({"SLURM_PROCID": "3", "SLURM_STEP_ID": "0",
            ...                       "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
            ...                       "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            ...                       "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "42"})
            >>> env.rank, env.node_rank, env.master_addr, env.master_port
            (3, 1, 'gpu07', 10672)
            >>> env = DistEnv.detect({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2",
            ...                       "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"})
            >>> env.rank, env.local_rank, env.source, env.master_port
            (1, 1, 'horovod', 0)
        """
        restarts = _int(environ, "TORCHELASTIC_RESTART_COUNT", 0)
        if "RANK" in environ and "WORLD_SIZE" in environ:
            rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
            local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
            return cls(
                rank=rank,
                local_rank=_int(environ, "LOCAL_RANK", rank % local_world),
                world_size=world,
                local_world_size=local_world,
                node_rank=_int(environ, "GROUP_RANK", rank // local_world),
                master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                master_port=_int(environ, "MASTER_PORT", 0),
                source="torchrun",
                restart_count=restarts,
            )
        if _is_slurm_step(environ):
            return _from_slurm(environ, restarts)
        for source, names in _RANK_VARIABLES:
            if names[0] in environ and names[1] in environ:
                return _from_rank_variables(environ, source, names)
        return cls(restart_count=restarts)


def launched_layout(env: DistEnv) -> dict[str, Any]:
    """The ``dist.*`` values that record the layout an outside launcher started, for the
    run's config.toml: ``launcher`` ("slurm"...), ranks on this node, nodes, this node's
    rank, and the master address and port the ranks met at.

    Example:
        >>> env = DistEnv(rank=1, world_size=2, node_rank=1, master_addr="n1",
        ...               master_port=10672, source="slurm", nodes=("n1", "n2"))
        >>> launched_layout(env)["nnodes"], launched_layout(env)["launcher"]
        ('2', 'slurm')
    """
    nnodes = len(env.nodes) or -(-env.world_size // env.local_world_size)
    return {"launcher": env.source, "nproc": env.local_world_size, "nnodes": str(nnodes),
            "node_rank": env.node_rank, "master_addr": env.master_addr,
            "master_port": env.master_port}


def export_for_torch(env: DistEnv) -> None:
    """Write ``env`` into ``os.environ`` the way ``torch.distributed``'s ``env://`` reads it.

    Example:
        >>> export_for_torch(DistEnv.detect())  # doctest: +SKIP
    """
    os.environ.update({
        "RANK": str(env.rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    })


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list such as ``"node[001-003,007],gpu5"`` into host names.

    Example:
        >>> expand_hostlist("node[001-002,007],gpu5")
        ['node001', 'node002', 'node007', 'gpu5']
    """
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        match = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
        if match is None:  # a plain host name
            hosts.append(item)
            continue
        prefix, ranges, rest = match.groups()
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise LaunchError(f"Cannot read the SLURM host list {text!r} (range {part!r}). "
                                  "Set MASTER_ADDR to the host of rank 0.")
            width = len(low)  # "001-003" keeps its zero padding
            for number in range(int(low), int(high or low) + 1):
                # The rest may hold another bracket group: "rack[1-2]-gpu[1-4]".
                hosts.extend(f"{prefix}{number:0{width}d}{tail}" for tail in
                             (expand_hostlist(rest) if "[" in rest else [rest]))
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM's tasks-per-node forms (``"4"``, ``"4(x2)"``, ``"2(x2),1"``) per node.

    Example:
        >>> parse_tasks_per_node("2(x2),1")
        [2, 2, 1]
    """
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise LaunchError(f"Cannot read the SLURM tasks-per-node value {text!r}. "
                              "Expected forms like '4', '4(x2)' or '2,1'.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_step_id(environ: Mapping[str, str] = os.environ) -> int | None:
    """The id of the ``srun`` step this process runs in, or None outside one.

    Only ``srun`` steps set ``SLURM_STEP_ID`` with ``SLURM_STEP_NUM_TASKS``; the batch
    script and an ``salloc`` shell carry the job's ``SLURM_PROCID``/``SLURM_NTASKS`` but no
    step variables, so they are never taken for a rank, whatever the job is named.

    Example:
        >>> slurm_step_id({"SLURM_STEP_ID": "2", "SLURM_STEP_NUM_TASKS": "4"})
        2
        >>> slurm_step_id({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}) is None
        True
    """
    if "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID", "")
    if not step.isdigit() or int(step) in _SLURM_SPECIAL_STEP_IDS:
        return None
    return int(step)


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port every rank of a step derives without talking (10000-29999).

    Two steps of one job running at once get distinct ports (step ids below 16).

    Example:
        >>> slurm_port(42, 0), slurm_port(42, 1)
        (10672, 10673)
    """
    return 10000 + (job_id * _STEPS_PER_JOB + step_id % _STEPS_PER_JOB) % 20000


def _is_slurm_step(environ: Mapping[str, str]) -> bool:
    # A one-task step (`srun -n1 gpufleet train --nproc 4`) is not a rank either: our own
    # launcher starts the ranks then.
    return (
        "SLURM_PROCID" in environ
        and slurm_step_id(environ) is not None
        and _int(environ, "SLURM_STEP_NUM_TASKS", 1) > 1
    )


def _from_slurm(environ: Mapping[str, str], restarts: int) -> DistEnv:
    # The step's layout, not the job's: `srun -N2 -n2` inside a job of 2 tasks a node
    # runs one rank per node.
    rank, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_STEP_NUM_TASKS")
    node_rank = _int(environ, "SLURM_NODEID", 0)
    nodes = tuple(expand_hostlist(environ.get("SLURM_STEP_NODELIST")
                                  or environ.get("SLURM_NODELIST", "")))
    per_node_text = environ.get("SLURM_STEP_TASKS_PER_NODE", "")
    if per_node_text:
        per_node = parse_tasks_per_node(per_node_text)
        local_world = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
    else:  # no per-node count: assume the tasks are spread evenly
        n_nodes = _int(environ, "SLURM_STEP_NUM_NODES", len(nodes) or 1)
        local_world = max(1, world // n_nodes)
    master_addr = environ.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1")
    # Every rank must agree on the port without talking: derive it from job and step.
    step = slurm_step_id(environ) or 0
    default_port = slurm_port(_int(environ, "SLURM_JOB_ID", 0), step)
    return DistEnv(
        rank=rank,
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=_int(environ, "MASTER_PORT", default_port),
        source="slurm",
        restart_count=restarts,
        nodes=nodes,
    )


# (source, (rank, size, local rank, local size, node rank)) for launchers that set no
# rendezvous address; the node rank variable may be missing.
_RANK_VARIABLES = (
    ("horovod", ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                 "HOROVOD_CROSS_RANK")),
    ("mpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE", "")),
    ("mpi", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "")),
)


def _from_rank_variables(environ: Mapping[str, str], source: str,
                         names: tuple[str, ...]) -> DistEnv:
    rank, world = _int(environ, names[0]), _int(environ, names[1])
    # Without per-node variables, assume one node (as the torchrun branch does).
    local_world = _int(environ, names[3], world)
    local_rank = _int(environ, names[2], rank % local_world)
    # With the same number of ranks on every node, the node index is rank // per node.
    node_rank = rank // local_world
    if names[4]:
        node_rank = _int(environ, names[4], node_rank)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT", 0),
        source=source,
        restart_count=0,  # neither launcher restarts ranks
    )


def _split_top_level(text: str) -> list[str]:
    """Split on the commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name, "")
    if value == "" and default is not None:
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"Environment variable {name} = {value!r} is not an integer. "
                          f"Unset it or give a whole number.") from None
