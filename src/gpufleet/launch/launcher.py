"""Start the ranks of a run on this node: torch's elastic agent, or plain process spawning.

``launcher="elastic"`` is what ``torchrun`` runs underneath (``elastic_launch``): it
restarts failed ranks (``max_restarts``), spans nodes through a rendezvous, and records
each rank's traceback in an error file. ``launcher="spawn"`` uses
``torch.multiprocessing.spawn``: one node, no restarts, but no agent process either
(handy in notebooks). Either way each rank runs ``fn(*args)`` with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, so
``DistEnv.detect()`` and ``init_process_group`` work inside it. The elastic agent starts
each rank as a command, ``python -m gpufleet.launch.rankmain PAYLOAD`` (as torchrun
starts a script): the rank imports what ``fn`` and its arguments need, and nothing of
the agent (see :mod:`.rankmain`).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from gpufleet.errors import LaunchError, RunStopped, unknown_choice
from gpufleet.fault.fatal import FORENSICS_ENV
from gpufleet.fault.preempt import (
    AGENT_SIGNALS,
    INTERRUPT_EXIT,
    REQUEUE_EXIT,
    exit_status,
    signal_name,
)
from gpufleet.launch.elastic_setup import (
    agent_made_with,
    fresh_store_per_restart,
    rendezvous_on_etcd,
    rendezvous_poll,
)
from gpufleet.launch.etcd_cluster import BACKEND as ETCD
from gpufleet.launch.etcd_cluster import TORCH_BACKEND
from gpufleet.launch.failures import describe_failures
from gpufleet.launch.netif import multi_node_network
from gpufleet.launch.rankmain import COMMAND, read_results, write_payload
from gpufleet.launch.rendezvous import LaunchPlan, parse_nnodes
from gpufleet.launch.store_client import RunGenerations, torch_run_id, wait_for_store

logger = logging.getLogger(__name__)

LAUNCHERS = ("elastic", "spawn")
_REOPEN_TRIES = 3  # rendezvous generations a start may skip, each closed by an ended run
_STORE_WAIT_S = 60.0  # at most this long for a store hosted elsewhere to answer
# Seconds an agent whose ranks finished waits for the other nodes' agents (torch's "exit
# barrier", 300 s by default) in an elastic run whose node count may change: the agents
# of nodes lost while their survivors went on in process never come.
ELASTIC_EXIT_BARRIER_S = 30.0


def launch(fn: Callable[..., Any] | str, args: tuple = (), *, nproc: int, launcher: str = "elastic",
           nnodes: str = "1", node_rank: int = 0, master_addr: str = "127.0.0.1",
           master_port: int = 0, rdzv_endpoint: str = "", rdzv_backend: str = "c10d",
           rdzv_id: str = "", max_restarts: int = 0, log_dir: str | None = None,
           rdzv_timeout: float = 600.0, rdzv_last_call_s: float = 30.0,
           rdzv_keep_alive_s: float = 5.0, rdzv_poll_s: float = 0.0,
           grow_in_process: bool = False) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` ranks on this node; return ``{global rank: result}``.

    ``fn``, ``args`` and the results must be picklable (ranks are spawned processes), so
    ``fn`` must be a module-level function of an importable module. On several nodes, run
    the same call on each; each node gets back the results of its own ranks.

    Args:
        fn: What each rank runs; it finds its rank with ``DistEnv.detect()``. Under the
            elastic launcher also a command (an executable, run with ``args``).
        args: Positional arguments for ``fn``.
        nproc: Ranks on this node.
        launcher: "elastic" (torch's elastic agent: restarts, multi-node) or "spawn"
            (``torch.multiprocessing``: one node, no restarts).
        nnodes: Nodes, "N" or "MIN:MAX" (elastic only).
        node_rank: This node's rank in a static multi-node run.
        master_addr: Node 0's address (static multi-node; the spawn launcher's store host).
        master_port: Node 0's port, needed for static multi-node (0: a free port).
        rdzv_endpoint: host:port of an elastic rendezvous; chooses the elastic mode.
        rdzv_backend: torch rendezvous backend for ``rdzv_endpoint`` (usually "c10d").
        rdzv_id: Rendezvous id shared by the nodes of an elastic run.
        max_restarts: Times the agent restarts all local ranks after a failure.
        log_dir: Directory for each rank's stdout/stderr and error files (elastic only;
            default: a temporary directory for the error files).
        rdzv_timeout: Seconds the nodes have to meet before the run fails (elastic only).
        rdzv_last_call_s: Seconds an elastic rendezvous that has its minimum of nodes still
            waits for more (torch's ``last_call_timeout``).
        rdzv_keep_alive_s: Seconds between an elastic agent's rendezvous heartbeats; a
            node silent for three of them is dropped from the next round.
        rdzv_poll_s: Seconds between an elastic agent's reads of the rendezvous state
            while it waits for the others to join or complete a round, and between its
            checks for nodes waiting to join (torch's own: 1); 0: by the node count
            (:func:`poll_for`).
        grow_in_process: in an elastic run whose node count may change, a node that
            joins joins the live ranks, which go on in their processes (see
            :mod:`.grow`; the ranks must support it: in-process recovery), instead of
            every node starting its ranks again.

    On several nodes the ranks talk over the interface that routes to the master or
    rendezvous address (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME, when unset), and the node
    that owns the rendezvous address hosts the c10d store (see :mod:`.netif`).

    Raises:
        LaunchError: a bad option, or a rank failed (the message names the ranks, their
            exit codes or signals, and the first traceback).

    Example:
        >>> results = launch(train_rank, (cfg,), nproc=2)  # doctest: +SKIP
        >>> results[0]  # rank 0's return value  # doctest: +SKIP
    """
    if nproc < 1:
        raise LaunchError(f"dist.nproc = {nproc}: need at least one rank. Pass --nproc 1 or more.")
    if max_restarts < 0:
        raise LaunchError(f"dist.max_restarts = {max_restarts} is negative. Pass 0 or more.")
    try:
        pickle.dumps(fn)  # by reference: cheap, and fails here rather than in every rank
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise LaunchError(f"{fn!r} cannot be sent to the ranks ({err}). Pass a function "
                          "defined at module level, not a lambda or a nested function.") from err
    if launcher == "elastic":
        plan = LaunchPlan.resolve(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                                  master_port=master_port, rdzv_endpoint=rdzv_endpoint,
                                  rdzv_backend=rdzv_backend, rdzv_id=rdzv_id)
        timeouts = RendezvousTimeouts(rdzv_timeout, rdzv_last_call_s, rdzv_keep_alive_s,
                                      rdzv_poll_s or poll_for(plan.max_nodes))
        return _launch_elastic(fn, args, nproc, plan, max_restarts, log_dir, timeouts,
                               grow_in_process)
    if launcher == "spawn":
        if parse_nnodes(nnodes) != (1, 1):
            raise LaunchError(f"launcher 'spawn' runs on one node, but dist.nnodes = {nnodes!r}."
                              " Use --launcher elastic for multi-node runs.")
        if max_restarts > 0:
            raise LaunchError(f"launcher 'spawn' cannot restart ranks (dist.max_restarts = "
                              f"{max_restarts}). Use --launcher elastic, or --max-restarts 0.")
        if log_dir:
            logger.warning("launcher 'spawn' keeps the ranks' output on this console; "
                           "log_dir=%s is only used by --launcher elastic", log_dir)
        return _launch_spawn(fn, args, nproc, master_addr, master_port or free_port(master_addr))
    raise LaunchError(unknown_choice("dist.launcher", launcher, LAUNCHERS))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (another process may take it later).

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def poll_for(max_nodes: int) -> float:
    """The rendezvous poll for a run of at most ``max_nodes`` nodes: 0.01 s a node, from
    0.1 s to torch's own 1 s. Every agent reads the rendezvous state from the store once
    a poll (torch's agent checks every 0.1 s for nodes waiting to join, and the state it
    reads is at most a poll old), so the store serves about 100 reads a second in all up
    to 100 nodes, as torch's 1 s gives at 100 nodes, while a small job's returning node
    joins sooner.

    Example:
        >>> poll_for(2), poll_for(40), poll_for(1000)
        (0.1, 0.4, 1.0)
    """
    return min(1.0, max(0.1, round(0.01 * max_nodes, 3)))


@dataclass(frozen=True)
class RendezvousTimeouts:
    """How long the agents of a run wait for each other.

    Attributes:
        join_s: Seconds the nodes have to meet before the run fails.
        last_call_s: Seconds an elastic rendezvous with its minimum of nodes waits for more.
        keep_alive_s: Seconds between rendezvous heartbeats; three missed drop a node.
        poll_s: Seconds between reads of the rendezvous state while an agent waits for
            the others (torch polls every second: a node that joins a running job waits
            for up to two such polls, its own and the running node's).
    """

    join_s: float = 600.0
    last_call_s: float = 30.0
    keep_alive_s: float = 5.0
    poll_s: float = 1.0

    def configs(self, backend: str) -> dict[str, int]:
        """The rendezvous settings torch's ``backend`` reads (whole seconds, at least 1)."""
        join, last_call = max(1, round(self.join_s)), max(1, round(self.last_call_s))
        if backend == "static":
            return {"timeout": join}
        return {"join_timeout": join, "last_call_timeout": last_call,
                "keep_alive_interval": max(1, round(self.keep_alive_s)),
                "keep_alive_max_attempt": 3}


def _launch_elastic(fn: Callable[..., Any], args: tuple, nproc: int, plan: LaunchPlan,
                    max_restarts: int, log_dir: str | None,
                    timeouts: RendezvousTimeouts = RendezvousTimeouts(),
                    grow_in_process: bool = False) -> dict[int, Any]:
    # With a log directory each rank's stdout/stderr also goes to a file there.
    logs = DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL if log_dir else Std.NONE)
    local_addr, network_configs = multi_node_network(plan)
    configs = {**timeouts.configs(plan.rdzv_backend), **network_configs, **plan.rdzv_configs}
    generations = _store_elsewhere(plan, configs, timeouts)
    generation = generations.current() if generations else 0
    # --rdzv-backend etcd: gpufleet's rendezvous on every etcd member (elastic_setup)
    torch_backend = TORCH_BACKEND if plan.rdzv_backend == ETCD else plan.rdzv_backend

    def launch_config() -> LaunchConfig:
        return LaunchConfig(
            min_nodes=plan.min_nodes, max_nodes=plan.max_nodes, nproc_per_node=nproc,
            logs_specs=logs, run_id=torch_run_id(plan.run_id, generation),
            rdzv_endpoint=plan.rdzv_endpoint, rdzv_backend=torch_backend,
            rdzv_configs=configs, local_addr=local_addr, max_restarts=max_restarts,
            start_method="spawn")
    logger.info("launching %d rank(s) with torch's elastic agent (%s rendezvous at %s, "
                "max_restarts=%d)", nproc, plan.mode, plan.rdzv_endpoint, max_restarts)
    # The agent forwards these to every rank and waits for them to checkpoint and end;
    # torch's launcher sets the variable in this process, restored when the ranks end
    # (a process that launches and goes on, Fleet.launch's, keeps its environment).
    signals_before = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", AGENT_SIGNALS)
    # The agent logs each failed rank's traceback; the LaunchError below says it once.
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)
    ranks_dir = None if isinstance(fn, str) else Path(tempfile.mkdtemp(prefix="gpufleet-ranks-"))
    # Each rank links its crash folder here (gpufleet.fault.fatal): a rank that dies by
    # a signal is then named with its last collective and line of code.
    forensics = tempfile.mkdtemp(prefix="gpufleet-forensics-")
    outer_forensics = os.environ.get(FORENSICS_ENV)
    os.environ[FORENSICS_ENV] = forensics
    try:
        if ranks_dir is not None:  # each rank: python -m gpufleet.launch.rankmain PAYLOAD
            args = (*COMMAND, str(_payload(ranks_dir, fn, args)))
        entry = fn if ranks_dir is None else sys.executable
        ranging = plan.min_nodes < plan.max_nodes
        barrier = ELASTIC_EXIT_BARRIER_S if ranging else None
        grow_in = ranks_dir if grow_in_process and ranging else None
        for tries_left in range(_REOPEN_TRIES, -1, -1):
            try:
                with fresh_store_per_restart(plan.rdzv_backend), \
                        rendezvous_on_etcd(plan), \
                        agent_made_with(barrier, grow_in), rendezvous_poll(timeouts.poll_s):
                    # A rank's exception lands in its error file (torch's @record around fn).
                    results = elastic_launch(launch_config(), entry)(*args)
                break
            except RendezvousClosedError:  # a run under this id ended: go to the next
                if not generations or not tries_left or _ranks_started(ranks_dir):
                    raise
                generation = generations.after_closed(generation)
        if ranks_dir is not None:
            results = {**dict.fromkeys(results), **read_results(ranks_dir)}
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if codes <= {REQUEUE_EXIT, INTERRUPT_EXIT}:  # the ranks got the signal, not the agent
            name = "SIGINT" if codes == {INTERRUPT_EXIT} else "SIGTERM or SIGUSR1"
            raise RunStopped(f"stopped by {name}: the ranks finished their step and wrote a "
                             "checkpoint.", max(codes), name) from None
        where = (f"Rank logs (stdout.log, stderr.log) and error files are under {log_dir}."
                 if log_dir else f"Error files are under {logs.root_log_dir}.")
        raise LaunchError(describe_failures(err, max_restarts, where, forensics)) from err
    except SignalException as err:  # the agent got it, passed it on, the ranks ended
        name = signal_name(err.sigval)
        raise RunStopped(f"stopped by {name}: the agent passed it to the ranks, which "
                         "finished their step and wrote a checkpoint.",
                         exit_status(err.sigval), name) from None
    except (RendezvousError, DistError) as err:
        if _ranks_started(ranks_dir):
            raise LaunchError(_store_lost(plan, err)) from err
        if isinstance(err, RendezvousClosedError):
            raise LaunchError(_closed(plan)) from err
        nodes = (f"{plan.min_nodes}" if plan.min_nodes == plan.max_nodes
                 else f"{plan.min_nodes} to {plan.max_nodes}")
        raise LaunchError(
            f"The agents did not meet ({plan.mode} rendezvous at {plan.rdzv_endpoint}, "
            f"{nodes} node(s), waited up to {timeouts.join_s:g} s): {err}\nEither a node "
            "never came (start the same command on every node: same endpoint and id, each "
            "static node its own --node-rank), or the address is wrong (it must be node "
            "0's, or that of the host running `gpufleet store`, reachable from every node: "
            "`gpufleet doctor --rdzv-endpoint HOST:PORT` shows the route), or a firewall "
            "blocks the port."
        ) from err
    finally:
        agent_log.setLevel(level)
        if signals_before is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals_before
        if ranks_dir is not None:
            shutil.rmtree(ranks_dir, ignore_errors=True)
        shutil.rmtree(forensics, ignore_errors=True)  # the links (their targets stay)
        if outer_forensics is None:
            os.environ.pop(FORENSICS_ENV, None)
        else:
            os.environ[FORENSICS_ENV] = outer_forensics
    if not log_dir:  # torch made a temporary directory for error files; none were needed
        shutil.rmtree(logs.root_log_dir, ignore_errors=True)
    return results


def _store_elsewhere(plan: LaunchPlan, configs: dict[str, Any],
                     timeouts: RendezvousTimeouts) -> RunGenerations | None:
    """For a c10d store this node does not host: wait until it answers, then its
    generations of the run's id (None when this node hosts the store)."""
    if plan.mode != "elastic" or plan.rdzv_backend != "c10d" or configs.get("is_host", True):
        return None
    # torch's own client gives up after a minute too (its read_timeout).
    wait = min(timeouts.join_s, _STORE_WAIT_S)
    wait_for_store(plan.rdzv_endpoint, wait)
    return RunGenerations(plan.rdzv_endpoint, plan.run_id, wait)


def _ranks_started(ranks_dir: Path | None) -> bool:
    return ranks_dir is not None and any(ranks_dir.glob("started-*"))


def _closed(plan: LaunchPlan) -> str:
    return (f"The rendezvous {plan.run_id!r} at {plan.rdzv_endpoint} is closed: a run under "
            "that id ended, and torch never reopens it. Give this run a new --rdzv-id (and "
            "--run-dir PATH to keep writing to the same run directory), or restart the "
            "store.")


def _store_lost(plan: LaunchPlan, err: BaseException) -> str:
    """The agents had met and ranks ran, then the rendezvous store went away."""
    return (f"The rendezvous store at {plan.rdzv_endpoint} stopped answering while the "
            f"job ran ({err}). The host that serves it (the one with that address: node 0, "
            "or the host running `gpufleet store`) was lost or cut off, and no node can go "
            "on without the store. Start the job again on the nodes left, with one of them "
            "as the endpoint: `--resume auto` continues from the newest checkpoint. To "
            "survive losing a training node next time, run the store on a host that does "
            "not train (`gpufleet store --port PORT` there, and --rdzv-endpoint "
            "THAT_HOST:PORT on every node).")


def _payload(directory: Path, fn: Callable[..., Any], args: tuple) -> Path:
    """The payload file every rank reads (see :mod:`.rankmain`)."""
    try:
        return write_payload(directory, fn, args)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise LaunchError(f"the arguments of {fn.__qualname__} cannot be sent to the ranks "
                          f"({err}). Pass objects defined at module level of an importable "
                          "file, not lambdas, nested functions or open handles.") from err


def _launch_spawn(fn: Callable[..., Any], args: tuple, nproc: int, addr: str,
                  port: int) -> dict[int, Any]:
    logger.info("spawning %d rank(s) with torch.multiprocessing (master %s:%d)", nproc, addr,
                port)
    queue = mp.get_context("spawn").SimpleQueue()
    context = mp.spawn(_spawn_entry, args=(fn, args, nproc, addr, port, queue), nprocs=nproc,
                       join=False)
    results: dict[int, Any] = {}
    try:
        # Drain while waiting: a rank blocks on a large result until someone reads it.
        while not context.join(timeout=0.2):
            _drain(queue, results)
    except mp.ProcessRaisedException as err:
        raise LaunchError(f"Rank {err.error_index} (pid {err.error_pid}) raised an exception; "
                          f"the other ranks were stopped.\n{err}\nThe spawn launcher cannot "
                          "restart ranks: use --launcher elastic with --dist.max_restarts."
                          ) from err
    except mp.ProcessExitedException as err:
        how = f"signal {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
        raise LaunchError(f"Rank {err.error_index} (pid {err.error_pid}) died with {how}; the "
                          "other ranks were stopped. The spawn launcher cannot restart ranks: "
                          "use --launcher elastic with --dist.max_restarts.") from err
    finally:
        for process in context.processes:  # e.g. on Ctrl-C: leave no rank behind
            if process.is_alive():
                process.terminate()
                process.join()
    _drain(queue, results)
    return {rank: results.get(rank) for rank in range(nproc)}  # None: the rank sys.exit(0)ed


def _drain(queue: Any, results: dict[int, Any]) -> None:
    while not queue.empty():
        rank, value = queue.get()
        results[rank] = value


def _spawn_entry(local_rank: int, fn: Callable[..., Any], args: tuple, nproc: int, addr: str,
                 port: int, queue: Any) -> None:
    """Body of each spawned rank: describe the rank the torchrun way, run fn, send back."""
    os.environ.update({
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": addr, "MASTER_PORT": str(port),
    })
    queue.put((local_rank, fn(*args)))
