"""A node that joins a running job joins its live ranks: the agents' side.

torch's elastic agent restarts its ranks whenever a node waits in the rendezvous: the
ranks already training stop, write a checkpoint, start again as new processes and read
it back, while the new node's ranks start. With in-process recovery on
(``fault.snapshot_every``, ``fault.recover_in_process``) gpufleet's agent keeps its live
ranks instead. On every agent of the round that takes the new node in:

1. the agent joins the round (torch's own rendezvous) and then says, in that round's
   store, whether it has live ranks (their ranks, its node's number, the address of the
   ranks' own store, which rank 0 hosts), or is new;
2. when live ranks are there, every agent works out the same :class:`Growth` from what
   all of them said: the live ranks keep their ranks ``0..W-1``, the new ones take
   ``W..`` in the order of their agents' group ranks, and new nodes get node numbers
   after the live ones;
3. an agent with live ranks keeps them running and leaves the growth in a file beside
   the ranks' payload (:data:`ORDER`), which a thread of each rank watches; an agent
   with new ranks starts them with the growth in :data:`JOIN_ENV`.

The agent is :class:`gpufleet.launch.grow_agent.GrowingAgent` (torch's agent is
imported only by the launcher, not by ranks). The ranks then meet in the live ranks'
store (:mod:`gpufleet.train.recovery.growing`): the new ones build their run and say they are
ready, the live ones agree at their next preemption check to stop after the same step,
everyone forms a new process group, and the new ranks take the training state from
rank 0 over it. No rank restarts and none reads a checkpoint. An agent that cannot
tell (no live ranks said so, a store address missing, ranks whose strategy cannot take
new ranks in) does what torch's agent does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

#: The environment variable a new rank finds its growth in (JSON).
JOIN_ENV = "GPUFLEET_JOIN"
#: The environment variable that names the folder of a rank's payload (see rankmain).
RANKS_DIR_ENV = "GPUFLEET_RANKS_DIR"
#: Set (to "1") in the ranks of an agent that keeps its live ranks when a node joins.
GROWS_ENV = "GPUFLEET_GROWS"
#: The file, in that folder, where an agent leaves a growth for its live ranks.
ORDER = "grow.json"
#: The files, in that folder, by which ranks say they can take new ranks in (their
#: strategy recovers in process, and they agree on steps at preemption checks), one per
#: local rank (``growable-<local rank>``) holding its rank and world size now; without
#: them their agent restarts them as torch's does.
GROWABLE = "growable"
#: Keys in the live ranks' store where rank 0 leaves its resolved config and the step
#: its run ends at, for new ranks to build the same run.
RUN_CONFIG, RUN_MAX_STEPS = "gpufleet/run/config", "gpufleet/run/max_steps"


def live_ranks(ranks_dir: Any, nproc: int) -> list[int] | None:
    """The ranks of this node's live processes as they said last (``growable-*``), or
    None when one of them did not say it can take new ranks in."""
    ranks = []
    for local in range(nproc):
        try:
            ranks.append(json.loads((ranks_dir / f"{GROWABLE}-{local}").read_text())["rank"])
        except (OSError, ValueError, KeyError):
            return None
    return sorted(ranks)
#: Where each agent says, in the round's store, whether its ranks are live.
SAID = "gpufleet/grow/agent"


@dataclasses.dataclass(frozen=True)
class Growth:
    """One node joining (or several) the live ranks, as every agent and rank sees it.

    Attributes:
        key: this growth's keys in the ranks' store (``gpufleet/grow/<id>``).
        world: the world size after it.
        live: how many ranks train now (they keep ranks ``0..live-1``).
        store: host and port of the live ranks' store (hosted by rank 0).
        new: ``{agent group rank: [(local rank, rank, node), ...]}`` of the new ranks.
    """

    key: str
    world: int
    live: int
    store: tuple[str, int]
    new: dict[int, list[tuple[int, int, int]]]

    @property
    def new_ranks(self) -> list[int]:
        return sorted(rank for ranks in self.new.values() for _, rank, _ in ranks)

    def dumps(self) -> str:
        return json.dumps({**dataclasses.asdict(self),
                           "new": {str(k): v for k, v in self.new.items()}})

    @classmethod
    def loads(cls, text: str) -> Growth:
        d = json.loads(text)
        return cls(d["key"], d["world"], d["live"], (d["store"][0], int(d["store"][1])),
                   {int(k): [tuple(x) for x in v] for k, v in d["new"].items()})


@dataclasses.dataclass(frozen=True)
class Joining:
    """What a new rank knows of the growth it joins: the growth, its rank, its node."""

    growth: Growth
    rank: int
    node: int


def joining() -> Joining | None:
    """This process's :class:`Joining` when its agent started it to join live ranks."""
    text = os.environ.get(JOIN_ENV)
    if not text:
        return None
    d = json.loads(text)
    rank, node = d["ranks"][os.environ.get("LOCAL_RANK", "0")]
    return Joining(Growth.loads(d["growth"]), int(rank), int(node))


def store_client(address: tuple[str, int], timeout_s: float) -> Any:
    """A client of the live ranks' store at ``address`` (rank 0 hosts it; with
    ``--rdzv-backend etcd`` it names their keys on the etcd cluster)."""
    from datetime import timedelta

    import torch.distributed as dist

    from gpufleet.launch.etcd_cluster import uses_etcd

    if uses_etcd():
        from gpufleet.launch.etcd_store import ranks_store  # deferred: python-etcd, slow

        return ranks_store(address, timeout_s)
    host, port = address
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def live_run(growth: Growth, timeout_s: float) -> tuple[dict[str, Any], int]:
    """Rank 0's resolved config (as a dict) and the step its run ends at, which a new
    rank builds with (its own plan may differ: settings resolved for another world)."""
    store = store_client(growth.store, timeout_s)
    return (json.loads(store.get(RUN_CONFIG).decode()),
            int(store.get(RUN_MAX_STEPS).decode()))


def plan_growth(said: dict[int, dict[str, Any]]) -> Growth | None:
    """The growth every agent works out from what each said (``{group rank: ...}``), or
    None when no agent has live ranks (a fresh start) or the live ones cannot be joined.

    Example:
        >>> g = plan_growth({0: {"live": [0, 1], "node": 0, "store": ["10.0.0.1", 5],
        ...                      "nproc": 2, "token": "ab"},
        ...                  1: {"live": [], "node": None, "store": None, "nproc": 2,
        ...                      "token": "cd"}})
        >>> g.world, g.live, g.new_ranks, g.new[1]
        (4, 2, [2, 3], [(0, 2, 1), (1, 3, 1)])
    """
    live = {g: s for g, s in said.items() if s["live"]}
    if not live:
        return None
    ranks = sorted(r for s in live.values() for r in s["live"])
    stores = {tuple(s["store"]) for s in live.values() if s["store"]}
    if ranks != list(range(len(ranks))) or len(stores) != 1:
        log.warning("the live ranks cannot be joined (ranks %s, stores %s): every node "
                    "starts its ranks again", ranks, sorted(stores))
        return None
    first = min(live)
    next_rank, next_node = len(ranks), max(s["node"] for s in live.values()) + 1
    new: dict[int, list[tuple[int, int, int]]] = {}
    for group in sorted(set(said) - set(live)):
        new[group] = [(local, next_rank + local, next_node)
                      for local in range(said[group]["nproc"])]
        next_rank, next_node = next_rank + said[group]["nproc"], next_node + 1
    host, port = next(iter(stores))
    return Growth(f"gpufleet/grow/{live[first]['token']}", next_rank, len(ranks),
                  (host, int(port)), new)
