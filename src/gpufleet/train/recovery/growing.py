"""A node that joins: the live ranks take its ranks in, in their own processes, and its
new ranks join them (the agents' side is :mod:`gpufleet.launch.grow`).

Each new rank builds its run without a process group and says so in rank 0's store; a
thread of each live rank watches for its agent's order and for the new ranks to be
ready, and the live ranks agree at their next preemption check (:class:`Regroup`) to
stop after the same step. Then every rank, old and new, joins one new process group and
rebuilds what depends on it as after a lost node (:meth:`Recovery.rebuild
<gpufleet.train.recovery.recovery.Recovery.rebuild>`); rank 0 sends its training state (model,
optimizer, scheduler, scaler, data position; the loop's ``LoopState.capture``) over it
and every rank restores it (sharded, fsdp and hsdp: one live rank per shard position
sends its shards, and every rank joins them, :mod:`gpufleet.train.recovery.reshard`). No rank
restarts and none reads a file; the live ranks lose no step. When it fails, the ranks
end and the agents restart them from the newest checkpoint.
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpufleet.core.collectives import gather_objects
from gpufleet.fault.receipt import Receipt
from gpufleet.files import atomic_write_text
from gpufleet.launch import job_store
from gpufleet.launch.grow import (
    GROWABLE,
    GROWS_ENV,
    ORDER,
    RANKS_DIR_ENV,
    RUN_CONFIG,
    RUN_MAX_STEPS,
    Growth,
    Joining,
    store_client,
)
from gpufleet.train.recovery.receipts import rank_facts, replayed, transfers_of
from gpufleet.train.recovery.recovery import THREAD_WAIT_S, Recovery, RecoveryFailed, leave_groups
from gpufleet.train.recovery.reshard import (
    as_pieces,
    assemble,
    broadcast_bytes,
    shard_position,
    share_states,
)

log = logging.getLogger(__name__)

# Seconds between a rank's looks for a node joining (its agent's order, then the new
# ranks' word that they are ready), on a thread of its own.
GROW_POLL_S = 0.1
GROW_CONNECT_S = 10.0  # for the watching thread's client of the live ranks' store
GROW_MEET_S = 60.0  # for the live ranks to meet the new ones in the new process group


class Regroup(Exception):
    """Raised by the loop at the step boundary where the ranks agreed to take new ranks
    in (:meth:`Growing.grow`)."""


class Growing:
    """This rank's part when a node joins (see the module docs): built by ``build_run``
    beside its :class:`Recovery` (``recovery.growing``), whose rebuilding it shares.

    Args:
        recovery: the run's in-process recovery.
        joining: this rank's place among the live ranks it was started to join (it joins
            before its first step), or None (it started with the others).
    """

    def __init__(self, recovery: Recovery, joining: Joining | None = None) -> None:
        self.recovery, self.run = recovery, recovery.run
        self.timeout_s = recovery.timeout_s
        #: this rank was started to join live ranks (it joins before its first step)
        self.joining = joining
        #: a growth whose new ranks are all ready (set by the watching thread)
        self.ready: Growth | None = None
        self._grown: set[str] = set()  # growths this rank took part in
        self._lock = threading.Lock()  # _grown and ready, between the threads
        self._stop = threading.Event()
        self._ready_at: float | None = None  # perf_counter when a growth's ranks were ready
        self._facts: list[dict] = []  # every rank's part of the last join's receipt
        ranks_dir = os.environ.get(RANKS_DIR_ENV)
        # This node's agent keeps live ranks when a node joins, and the ranks agree on
        # steps at preemption checks (where they agree to take new ones in).
        grows = os.environ.get(GROWS_ENV) == "1" and self.run.monitors.preemption is not None
        self._order = Path(ranks_dir) / ORDER if ranks_dir and grows else None
        if self._order is not None and joining is None:
            if self.run.env.is_main:  # what a new rank builds with: this run's settings
                self._publish_run(recovery.store)
            self.say_growable()
            self._start_watch()

    def close(self) -> None:
        """Stop watching for nodes that join."""
        self._stop.set()

    def say_growable(self) -> None:
        """Tell this node's agent, in a file, that this rank can take new ranks in and
        where it is now (its rank, the world size); again after every regroup."""
        if self._order is None:
            return
        env = self.run.env
        atomic_write_text(self._order.parent / f"{GROWABLE}-{env.local_rank}",
                          json.dumps({"rank": env.rank, "world": env.world_size}))

    def grow(self) -> None:
        """Take the new ranks in (a live rank, at the step boundary the ranks agreed on,
        :class:`Regroup`): leave the process group, form the new one with them, and go
        on from rank 0's state. Raises :class:`RecoveryFailed` when that fails (the rank
        then ends and the agent restarts the ranks from the newest checkpoint)."""
        start, run, began_t = time.perf_counter(), self.run, time.time()
        keeper = run.monitors.receipts
        median_step, _ = keeper.begin() if keeper is not None else (None, None)
        ready_at, self._ready_at = self._ready_at, None
        recovery = self.recovery
        recovery.phases, recovery.received = {}, []
        clock = recovery._clock()
        growth = self.ready or self._wait_for_order()
        old_world = run.env.world_size
        if growth.live != old_world:  # planned before a loss regrouped these ranks
            raise RecoveryFailed(f"the node joining was planned for {growth.live} live "
                                 f"rank(s); {old_world} train now")
        snaps = run.monitors.snapshots
        if snaps is not None and not snaps.snapshotter.wait(THREAD_WAIT_S):
            raise RecoveryFailed(f"the snapshot exchange still ran after {THREAD_WAIT_S:g} s")
        recovery.loop.wait()
        leave_groups(run.device)
        clock("leave")
        step = self._together(growth, run.env.rank)
        went_on = time.perf_counter()
        log.warning("rank %d: %d new rank(s) joined at step %d, world %d -> %d, in %.2f s; "
                    "no restart, no checkpoint read", run.env.rank, growth.world - old_world,
                    step, old_world, growth.world, went_on - start,
                    extra={"world_size": growth.world})
        if keeper is not None and run.env.is_main:
            facts = self._facts
            samples, _ = replayed(run, step, began_t)
            keeper.settle(Receipt(
                "join", began_t, step, old_world, growth.world, list(growth.new_ranks),
                "a node asking to join (its ranks ready; the time until the step the "
                "live ranks agreed on)",
                None if ready_at is None else start - ready_at, dict(recovery.phases),
                went_on - start, transfers_of(facts, run.monitors.links),
                median_step_s=median_step,
                steps_repeated=max(f["steps"] for f in facts[:growth.live]) - step,
                samples_replayed=samples), went_on)

    def join(self) -> None:
        """This new rank joins the live ones (before its first step): say it is ready,
        wait for them in the new process group, and take rank 0's state."""
        start, joining = time.perf_counter(), self.joining
        assert joining is not None
        self.recovery.phases, self.recovery.received = {}, []
        store = store_client(joining.growth.store, self.timeout_s)
        store.set(f"{joining.growth.key}/ready/{joining.rank}", "1")
        step = self._together(joining.growth, joining.rank, store)
        self.joining = None
        if self._order is not None:  # later nodes join through this node's agent too
            self._start_watch()
        log.warning("rank %d joined the %d live rank(s) at step %d in %.2f s (%d in all), "
                    "from %s; no checkpoint read", joining.rank,
                    joining.growth.live, step, time.perf_counter() - start,
                    joining.growth.world,
                    "their shards" if self.recovery.reshards else "rank 0's state")

    # -- the watching thread ------------------------------------------------------------
    def _start_watch(self) -> None:
        threading.Thread(target=self._watch_for_growth, daemon=True,
                         name="gpufleet-grow-watch").start()

    def _publish_run(self, store: Any) -> None:
        """Rank 0: its resolved config and the step its run ends at, in its store's own
        keys, for new ranks to build the same run (:func:`gpufleet.launch.grow.live_run`)."""
        from gpufleet.config.loader import config_to_dict

        raw = store
        while isinstance(raw, dist.PrefixStore):  # the store's own keys, not the group's
            raw = raw.underlying_store
        raw.set(RUN_CONFIG, json.dumps(config_to_dict(self.run.cfg)))
        raw.set(RUN_MAX_STEPS, str(self.run.max_steps))

    def _watch_for_growth(self) -> None:
        """The watching thread: wait for this node's agent's order, then for every new
        rank to say it is ready, and raise :attr:`ready` for the loop's next preemption
        check (the live ranks agree there). Polls a file and, once a growth is on, the
        store: nothing on the training thread."""
        store = None
        while not self._stop.wait(GROW_POLL_S):
            growth = self._read_order()
            if growth is None or growth.key in self._grown or self.ready:
                continue
            try:
                store = store if store is not None else store_client(growth.store,
                                                                     GROW_CONNECT_S)
                ready = store.check([f"{growth.key}/ready/{r}" for r in growth.new_ranks])
            except Exception as e:  # the store went away: the recovery path says more
                log.debug("watching for a node that joins: %s", e)
                store = None
                continue
            with self._lock:  # not a growth the training thread finished meanwhile
                if ready and growth.key not in self._grown:
                    self.ready = growth
                    self._ready_at = time.perf_counter()

    def _read_order(self) -> Growth | None:
        try:
            return Growth.loads(self._order.read_text()) if self._order else None
        except (OSError, ValueError, KeyError):  # none yet, or being replaced
            return None

    def _wait_for_order(self) -> Growth:
        deadline = time.monotonic() + THREAD_WAIT_S
        while time.monotonic() < deadline:
            growth = self._read_order()
            if growth is not None and growth.key not in self._grown:
                return growth
            time.sleep(GROW_POLL_S)
        raise RecoveryFailed("the ranks agreed that a node joins, but this node's agent "
                             f"gave no order within {THREAD_WAIT_S:g} s")

    # -- old and new ranks together -----------------------------------------------------
    def _together(self, growth: Growth, rank: int, store: Any = None) -> int:
        """Every rank of ``growth``, old and new: one process group, the run rebuilt for
        it, rank 0's state restored. Returns the step it resumes after. COLLECTIVE."""
        run, recovery = self.run, self.recovery
        clock = recovery._clock()
        steps_done = run.state.step if rank < growth.live else 0
        store = store if store is not None else store_client(growth.store, self.timeout_s)
        with self._lock:
            self._grown.add(growth.key)
            self.ready = None
        # Rank 0's whole state, as the live ranks' world left it (so that every rank
        # splits the rest of the epoch anew and seeds itself for its new rank): what a
        # checkpoint holds, read the same on every rank, rank 0 included. Sharded
        # (fsdp, hsdp): each live rank's shards, joined into the whole state below.
        mine = None
        if rank < growth.live:
            mine = {"state": recovery.loop.capture(), "max_steps": run.max_steps}
        # The live ranks come last, to new ranks that said they are ready: they wait for
        # the group only GROW_MEET_S (a new rank that died since fails the join then,
        # not after dist.timeout), and the group's collectives get dist.timeout after.
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        meet_s = self.timeout_s if rank >= growth.live or set_timeout is None else \
            min(self.timeout_s, GROW_MEET_S)
        dist.init_process_group(
            recovery.backend, store=dist.PrefixStore(f"{growth.key}/pg", store), rank=rank,
            world_size=growth.world, timeout=timedelta(seconds=meet_s))
        if meet_s != self.timeout_s and set_timeout is not None:
            set_timeout(timedelta(seconds=self.timeout_s))
        clock("regroup")
        if recovery.reshards:
            sent = self._live_shards(mine, rank, growth.live)
            clock("transfer")
            recovery.rebuild(rank, growth.world)
            clock("regroup")
        else:
            data = None
            if rank == 0:
                buffer = io.BytesIO()
                torch.save(mine, buffer)
                data = buffer.getvalue()
            clock("transfer")
            recovery.rebuild(rank, growth.world)
            clock("regroup")
            sent = torch.load(io.BytesIO(broadcast_bytes(data, run.device,
                                                         received=recovery.received)),
                              weights_only=True, map_location="cpu")  # into the live tensors
            clock("transfer")
        run.max_steps = sent["max_steps"]
        recovery.restore(sent["state"], "rank 0's live state")
        clock("restore")
        if run.monitors.preemption is not None:
            run.monitors.preemption.regroup()  # COLLECTIVE where it has a group
        if run.monitors.snapshots is not None:
            run.monitors.snapshots.rejoin(rank, growth.world)  # COLLECTIVE
        # Keys every rank shares from here on (old and new ranks started apart).
        recovery.store, recovery.prefix, recovery.generation = \
            store, f"{growth.key}/recover", 0
        if run.monitors.watchdog is not None:
            run.monitors.watchdog.prefix = f"{growth.key}/watchdog"
            run.monitors.watchdog.rejoin(rank, growth.world, job_store(), 0)
        self.say_growable()
        # COLLECTIVE: what each rank saw, for rank 0's receipt (one small gather).
        self._facts = gather_objects(rank_facts(run, steps_done, recovery.received))
        clock("regroup")
        return run.state.step

    def _live_shards(self, mine: Any, rank: int, live: int) -> Any:
        """The live ranks' whole state (and end step), joined from one live rank's
        shards per shard position: rank 0 names them (only the live ranks know their
        mesh), each named rank sends its own. COLLECTIVE over the new group."""
        chosen = None
        if rank == 0:
            dims = self.run.strategy.dims  # the live ranks' mesh, until rebuild()
            first: dict[int, int] = {}
            for r in range(live):
                first.setdefault(shard_position(r, dims), r)
            chosen = json.dumps([first[p] for p in sorted(first)]).encode()
        owners = json.loads(broadcast_bytes(chosen, self.run.device))
        held = {rank: as_pieces(mine)} if rank in owners else {}
        states = share_states(held, {owner: owner for owner in owners}, self.run.device,
                              self.recovery.received)
        return assemble([states[owner] for owner in owners])
