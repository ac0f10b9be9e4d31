"""torch's elastic launcher, adjusted for the length of one launch: what it has no
setting for. Each is a context manager that puts torch's own piece back on the way out.

- :func:`fresh_store_per_restart`: the ranks of every restart get a new store;
- :func:`agent_made_with`: the agent's exit barrier, and gpufleet's agent that keeps its
  live ranks when a node joins (:mod:`.grow_agent`);
- :func:`rendezvous_poll`: how often the c10d rendezvous reads its state while it waits;
- :func:`rendezvous_on_etcd`: the rendezvous and the ranks' stores on an etcd cluster.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.launcher import api as torch_launcher

from gpufleet.launch.etcd_cluster import BACKEND as ETCD
from gpufleet.launch.etcd_cluster import ENDPOINTS_ENV
from gpufleet.launch.rendezvous import LaunchPlan


@contextmanager
def fresh_store_per_restart(rdzv_backend: str) -> Iterator[None]:
    """Give the ranks of every restart a new TCPStore (unless the user chose otherwise),
    and, on etcd, every rendezvous round its own master address.

    With the c10d rendezvous, torch's agent shares one TCPStore with the ranks and keeps
    it across restarts, so restarted ranks can read the previous attempt's keys (gloo then
    connects to a dead rank's port: "Connection refused"). With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (read by the agent, in this process) rank 0 of
    each attempt hosts a new store on a port the agent picks.

    On etcd (``--rdzv-backend etcd``) the ranks' store is the cluster's, in keys named by
    the round's master address (:func:`~gpufleet.launch.etcd_store.ranks_store`); but a
    shared store makes torch's agent keep the address of the first round it completed,
    and write it only then: a node whose first round is a later one (one that came after
    the others completed a round without it, or one started again) waits for it in vain,
    its store's timeout long. Unshared, rank 0's agent writes a new address every round.
    """
    name = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    if rdzv_backend not in ("c10d", ETCD) or name in os.environ:
        yield
        return
    os.environ[name] = "1"
    try:
        yield
    finally:
        os.environ.pop(name, None)


@contextmanager
def agent_made_with(exit_barrier_s: float | None, grow_in: Path | None = None) -> Iterator[None]:
    """Have torch's launcher make its agent with an exit barrier of ``exit_barrier_s``
    (None: torch's default), and with ``grow_in`` (the ranks' payload folder) gpufleet's agent
    that keeps its live ranks when a node joins (:class:`.grow_agent.GrowingAgent`).
    ``LaunchConfig`` has no such fields: the agent class the launcher builds is given
    them for the duration of the launch."""
    if exit_barrier_s is None and grow_in is None:
        yield
        return
    agent_class = torch_launcher.LocalElasticAgent
    if grow_in is not None:
        from gpufleet.launch.grow_agent import GrowingAgent

        agent_class = functools.partial(GrowingAgent, ranks_dir=grow_in)  # type: ignore
    original = torch_launcher.LocalElasticAgent
    barrier = {} if exit_barrier_s is None else {"exit_barrier_timeout": exit_barrier_s}

    def agent(*args: Any, **kwargs: Any) -> Any:
        return agent_class(*args, **barrier, **kwargs)

    torch_launcher.LocalElasticAgent = agent  # type: ignore[assignment, misc]
    try:
        yield
    finally:
        torch_launcher.LocalElasticAgent = original  # type: ignore[misc]


@contextmanager
def rendezvous_poll(seconds: float) -> Iterator[None]:
    """Have torch's c10d rendezvous read its shared state every ``seconds`` while it waits
    for other nodes, instead of every second.

    torch hard-codes that second twice, with no setting for either: its rendezvous loop
    sleeps a second between reads (``_delay(seconds=1)``), and its state holder serves a
    copy of the state up to a second old instead of reading the store again
    (``cache_duration=1``). A node started again to rejoin a running job waits out
    several of them before the round that takes it in completes. Each read is one read
    of the store by each agent: while it waits, and while its ranks train too (torch's
    agent checks every 0.1 s for nodes waiting to join, from the copy of the state), so
    a shorter poll costs the store more reads (:func:`~gpufleet.launch.launcher.poll_for`
    scales the default with the node count). Nothing changes for ``seconds >= 1`` or a
    torch without those names.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    delay = getattr(rdzv, "_delay", None)
    holder = getattr(rdzv, "_BackendRendezvousStateHolder", None)
    if seconds >= 1.0 or delay is None or holder is None:
        yield
        return

    def poll(seconds: Any) -> None:  # torch calls it as _delay(seconds=...)
        delay(seconds=shorter if seconds == 1 else seconds)

    class FresherState(holder):  # type: ignore[misc, valid-type]
        def __init__(self, backend: Any, settings: Any, cache_duration: float = 1) -> None:
            super().__init__(backend, settings, min(cache_duration, shorter))

    shorter = seconds
    rdzv._delay, rdzv._BackendRendezvousStateHolder = poll, FresherState
    try:
        yield
    finally:
        rdzv._delay, rdzv._BackendRendezvousStateHolder = delay, holder


@contextmanager
def rendezvous_on_etcd(plan: LaunchPlan) -> Iterator[None]:
    """With ``--rdzv-backend etcd``: torch's agent finds gpufleet's rendezvous on every
    member of the etcd cluster (:data:`~gpufleet.launch.etcd_cluster.TORCH_BACKEND`), and
    the ranks it starts find the cluster's endpoints in their environment, for their own
    store (:func:`~gpufleet.launch.etcd_store.ranks_store`).

    Raises:
        LaunchError: python-etcd is missing, or no member answers (checked here, before
            torch's agent would report it as a failed rendezvous).
    """
    if plan.rdzv_backend != ETCD:
        yield
        return
    # Deferred: python-etcd takes seconds to import, and only this backend needs it.
    from gpufleet.launch.etcd_store import client, register_rendezvous

    client(plan.rdzv_endpoint)  # a clear error now rather than torch's later
    register_rendezvous()
    name, previous = ENDPOINTS_ENV, os.environ.get(ENDPOINTS_ENV)
    os.environ[name] = plan.rdzv_endpoint  # the agents pass their environment on
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
