"""gpufleet's elastic agent: torch's local agent, which keeps its live ranks when a node
joins (see :mod:`gpufleet.launch.grow`)."""

from __future__ import annotations

import json
import logging
import os
import secrets
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from gpufleet.files import atomic_write_text
from gpufleet.launch.grow import (
    GROWABLE,
    GROWS_ENV,
    JOIN_ENV,
    ORDER,
    SAID,
    Growth,
    live_ranks,
    plan_growth,
)

log = logging.getLogger(__name__)

_SAY_TIMEOUT_S = 60.0  # for the other agents of the round to say whether theirs are live


class GrowingAgent(LocalElasticAgent):
    """torch's local agent that keeps its live ranks when a node joins (see
    :mod:`gpufleet.launch.grow`); ``ranks_dir``: the folder of the ranks' payload, where
    the order for them goes."""

    def __init__(self, *args: Any, ranks_dir: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ranks_dir = ranks_dir
        self._live: list[int] = []  # the ranks running here, while a node joins
        self._node: int | None = None
        self._growth: Growth | None = None
        # Where this node's ranks keep their store (rank 0 hosts it): the round's master
        # when they started, the live ranks' own when they joined them.
        self._ranks_store: tuple[str | None, int | None] = (None, None)

    # -- torch's agent, where a node joins ------------------------------------------------
    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        live = live_ranks(self._ranks_dir, worker_group.spec.local_world_size)
        if worker_group.state != WorkerState.HEALTHY or live is None:
            # A failure, or ranks that cannot take new ones in (their strategy does not
            # recover in process): torch's restart.
            super()._restart_workers(worker_group)
            return
        # A node waits to join and this node's ranks run: take it in without them ending.
        running = {w.local_rank: w for w in worker_group.workers}
        self._live = live
        self._node = worker_group.group_rank
        try:
            self._rendezvous(worker_group)
        finally:
            self._live, self._node = [], None
        growth = self._growth
        if growth is None:  # nobody could plan it: what torch does, after the round
            log.warning("a node joins: this node's ranks start again (no live ranks to "
                        "join)")
            self._stop_workers(worker_group)
            self._start_again(worker_group)
            return
        ranks = dict(zip(sorted(running), live))  # local rank -> rank, as they said
        for worker in worker_group.workers:  # the same processes, still watched
            worker.id = running[worker.local_rank].id
            worker.global_rank = worker.role_rank = ranks[worker.local_rank]
            worker.world_size = worker.role_world_size = growth.world
        atomic_write_text(self._ranks_dir / ORDER, growth.dumps())
        log.info("a node joins the %d live rank(s): %d rank(s) in all, without a restart",
                 growth.live, growth.world)
        worker_group.state = WorkerState.HEALTHY

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._growth = self._say(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # The ranks inherit this process's environment: they watch for nodes that join,
        # and the new ranks of a growth find their rank and node in it.
        growth, group = self._growth, worker_group.group_rank
        os.environ[GROWS_ENV] = "1"
        # New processes: what the ones before them said or were told is stale.
        for path in self._ranks_dir.glob(f"{GROWABLE}-*"):
            path.unlink(missing_ok=True)
        (self._ranks_dir / ORDER).unlink(missing_ok=True)
        if growth is None or group not in growth.new:
            self._ranks_store = (worker_group.master_addr, worker_group.master_port)
        else:
            self._ranks_store = growth.store
            ranks = {str(local): [rank, node] for local, rank, node in growth.new[group]}
            os.environ[JOIN_ENV] = json.dumps({"growth": growth.dumps(), "ranks": ranks})
            for worker in worker_group.workers:  # their ranks among the live ones
                worker.global_rank = worker.role_rank = int(ranks[str(worker.local_rank)][0])
                worker.world_size = worker.role_world_size = growth.world
        try:
            return super()._start_workers(worker_group)
        finally:
            os.environ.pop(JOIN_ENV, None)
            os.environ.pop(GROWS_ENV, None)

    # -- the rest ---------------------------------------------------------------------------
    def _start_again(self, worker_group: WorkerGroup) -> None:
        """Start this node's ranks for the round just made (torch's restart without its
        second rendezvous)."""
        worker_group.state = WorkerState.STOPPED
        ids = self._start_workers(worker_group)
        for local_rank, pid in ids.items():
            worker_group.workers[local_rank].id = pid
        worker_group.state = WorkerState.HEALTHY

    def _say(self, worker_group: WorkerGroup) -> Growth | None:
        """Tell the round's other agents whether this node's ranks are live, hear what
        they said, and plan the growth (the same on every agent)."""
        store, me, old_store = worker_group.store, worker_group.group_rank, self._ranks_store
        live = bool(self._live) and old_store[0] is not None
        store.set(f"{SAID}/{me}", json.dumps({
            "live": self._live if live else [], "node": self._node,
            "store": list(old_store) if live else None,
            "nproc": worker_group.spec.local_world_size, "token": secrets.token_hex(6)}))
        keys = [f"{SAID}/{g}" for g in range(worker_group.group_world_size)]
        store.wait(keys, timedelta(seconds=_SAY_TIMEOUT_S))
        said = {g: json.loads(store.get(k)) for g, k in enumerate(keys)}
        return plan_growth(said)
