"""Recovery without a cold start: the ranks left after a lost node go on in their own
processes, from the newest in-memory snapshot (``fault.snapshot_every``).

When a collective of training fails because peers vanished (gloo raises on the
connection a dead peer's kernel closed), every rank left, in :meth:`Recovery.recover`:

1. waits for its own snapshot copy in flight and for the snapshot thread (whose exchange
   with a lost partner fails the same way), then leaves the broken process group: every
   group destroyed, NCCL's communicators aborted first;
2. reports to the job's store (hosted by rank 0's process and kept across groups, or,
   with ``--rdzv-backend etcd``, the etcd cluster) under keys of this recovery's
   *generation*, so that a second loss meets in fresh keys: its rank and the step of
   the snapshot it holds. Every rank waits for the reports, at most
   ``fault.recover_window_s`` (less when every rank reported), and proposes a decision;
   the first the store takes (``compare_set``) holds for all: the ranks that reported
   go on, in rank order, from the newest step they all hold
   (:func:`~gpufleet.fault.snapshot_ring.newest_replicated`);
3. joins a new process group with them, and rebuilds what depends on it: the strategy's
   degrees and mesh, the DDP wrappers, its data shard, the ring of snapshot partners, the
   watchdog's heartbeats;
4. restores its own snapshot with the checkpointer's own code (model, optimizer,
   scheduler, scaler, the global data position, which splits the rest of the epoch over
   the new world: every sample read once). No file is read.

**Sharded state** (fsdp, hsdp): rank 0 also names, per position along the shard
dimension, whose copy makes the whole state and who holds it (a survivor's own, or the
partner copy of a lost rank); the holders send them over the new group, every rank
joins them, builds its models again from their skeletons over the new mesh (with new
optimizers) and loads the whole state (:mod:`gpufleet.train.recovery.reshard`).

**A node that joins** (started again, or a new one in an elastic node range) joins the
live ranks the same way, rebuilding as in step 3 (:mod:`gpufleet.train.recovery.growing`).

In any other case the rank raises the original error, ends, and the elastic agent
restarts the ranks from the newest checkpoint (the agent-restart path, as without
snapshots); the log says which path was taken and why. That happens when the error is
not a lost peer (every rank reported), when the strategy's state is split in ways not
put together again (zero1, pipeline, tensor or local SGD: decided when the run is built),
when no snapshot of one step is held by every rank left (sharded: for every shard
position), when rank 0 (the store's host, unless the stores are on etcd) is
lost, or when a step of the recovery fails or times out.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import re
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet.core.collectives import gather_objects
from gpufleet.core.tree import map_tensors
from gpufleet.data.sampler import ResumableDistributedSampler
from gpufleet.data.stream_shard import StreamShard
from gpufleet.fault.liveness import Verdict
from gpufleet.fault.receipt import Receipt
from gpufleet.fault.snapshot_ring import Held, newest_replicated, newest_sharded
from gpufleet.launch import job_store
from gpufleet.launch.rendezvous import parse_nnodes
from gpufleet.parallel.base import Strategy, why_not_in_process
from gpufleet.parallel.data_parallel import replicate
from gpufleet.train.recipe import place_scheduler
from gpufleet.train.recovery.disconnect import cut_connections, cut_old_group
from gpufleet.train.recovery.loopstate import LoopState
from gpufleet.train.recovery.receipts import rank_facts, replayed, transfers_of
from gpufleet.train.recovery.reshard import (
    rebuilt_from_sources,
    shard_position,
    whole_from_snapshots,
)

log = logging.getLogger(__name__)

# Seconds a rank waits for its snapshot thread (copy and exchange) to end before it
# leaves the process group; an exchange with a lost partner fails as soon as its
# connection closes.
THREAD_WAIT_S = 10.0
# What gloo, NCCL and the store say when a peer vanished (besides torch's DistError).
_PEER_LOST = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused",
              "ProcessGroup", "Gloo", "gloo", "NCCL", "peer")


class RecoveryFailed(RuntimeError):
    """In-process recovery cannot go on; the agent-restart path takes over."""


@dataclasses.dataclass(frozen=True)
class Membership:
    """What rank 0 decided for one generation: the old ranks that go on (in their new
    rank order), the snapshot step they restore (None: no common snapshot) and, for
    shards, which old rank's copies make the whole state and who holds each."""

    ranks: tuple[int, ...]
    step: int | None
    sources: dict[int, int] = dataclasses.field(default_factory=dict)  # owner -> holder


def not_replicated(strategy: Strategy, sampler: Any, reshards: bool = False,
                   nnodes: str = "1") -> str:
    """Why in-process recovery cannot serve this run ("" when it can): it needs every
    rank to hold the whole model and optimizer state (plain replicas, as ddp keeps
    them), or FSDP2's shards that it can put together again (``reshards``: fsdp and
    hsdp, each model with a :class:`~gpufleet.train.recovery.reshard.Source`), the global data
    position of the resumable sampler (None: the loop keeps its data position itself,
    see :class:`~gpufleet.train.recovery.loopstate.LoopState`), and a node count
    (``dist.nnodes``) that the ranks left can make: a range, or "1" where another
    launcher started the job."""
    reason = why_not_in_process(type(strategy), strategy.dims, reshards)
    if reason:
        return reason
    fewest, most = parse_nnodes(nnodes)
    if fewest == most > 1:
        return (f"dist.nnodes = {nnodes!r} is a fixed node count, which the ranks left "
                "cannot make (give a range, e.g. --nnodes 1:2, to go on without a lost node)")
    # (a stream's share keeps a global position too: the items every rank read)
    if sampler is not None and not isinstance(sampler,
                                              (ResumableDistributedSampler, StreamShard)):
        return "data.batching = 'tokens' plans batches for the world size it started with"
    return ""


def is_peer_loss(error: BaseException) -> bool:
    """Whether ``error`` looks like a collective (or the store) failing on a peer that
    vanished, rather than a mistake in the training code."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(k in str(error) for k in _PEER_LOST)


class Recovery:
    """Regroups the ranks left after a loss, in process (see the module docs). Built by
    ``build_run`` when snapshots are on, several ranks train and the strategy keeps
    whole replicas; the loop calls :meth:`recover` when a step raises.

    Args:
        run: the run to rebuild (its parts are changed in place).
        store: the job's key-value store (rank 0's; kept alive here across groups).
        backend: the process group's backend, for the new group.

    What it restores is the run's ``loop_state`` (a
    :class:`~gpufleet.train.recovery.loopstate.LoopState`: the built-in loop's
    checkpointer and stream, or what your loop registered with
    ``fleet.register_state``).
    """

    def __init__(self, run: Any, store: Any, backend: str) -> None:
        self.run, self.store, self.backend = run, store, backend
        #: the state is FSDP2's shards: put together again from every shard position
        #: (gpufleet.train.recovery.reshard), the models built again over the new mesh
        self.reshards = rebuilt_from_sources(run.parts)
        # The job's store as the process group made it: on rank 0 it holds the store's
        # server, which must live as long as the process (later stores are clients).
        self._server = store
        self.generation = 0
        self.prefix = f"gpufleet/recover/{run.env.restart_count}"
        self.window_s = run.cfg.fault.recover_window_s
        self.timeout_s = float(run.cfg.dist.timeout)
        if run.monitors.watchdog is not None:  # a node cut off: heartbeats name it
            run.monitors.watchdog.on_peers_lost = self.peers_silent
        #: this rank's part when a node joins (a gpufleet.train.recovery.growing.Growing), or None
        self.growing: Any = None
        #: seconds per receipt phase of the recovery under way (fault.receipt.PHASES)
        self.phases: dict[str, float] = {}
        #: the transfers this rank received in it: (sender, bytes, seconds)
        self.received: list[tuple[int, int, float]] = []
        # The watchdog's last verdict of silent ranks: (perf_counter, ranks, silent s).
        self._silent: tuple[float, list[int], float] | None = None

    @property
    def loop(self) -> LoopState:
        """The loop's state this recovery restores (the run's ``loop_state``)."""
        loop = self.run.loop_state
        assert loop is not None, "a recovery is built only for a run with a loop state"
        return loop

    def peers_silent(self, verdict: Verdict) -> bool:
        """The watchdog's heartbeats found ranks that stopped answering (a node cut off:
        no connection closes, and the collective would wait out dist.timeout). Make
        the training thread's collective fail now, as a killed node's closed connections
        do, so that it recovers without them: NCCL's communicators are aborted; gloo
        cannot abort an operation under way (it waits out its timeout), so this
        process's TCP connections to the silent ranks' nodes are shut down. False (the
        rank then ends) when a silent rank's node address is unknown or this node's."""
        run = self.run
        ours = run.monitors.watchdog.node[1] if run.monitors.watchdog is not None else ""
        addresses = {(beat or {}).get("addr") or "" for beat in verdict.silent.values()}
        if "" in addresses or ours in addresses:
            return False
        ages = [float((beat or {}).get("age_s") or 0.0) for beat in verdict.silent.values()]
        self._silent = (time.perf_counter(), sorted(verdict.silent), max(ages, default=0.0))
        log.warning("rank %d: rank(s) %s stopped answering; cutting the connections to "
                    "%s to go on without them", run.env.rank,
                    ", ".join(map(str, sorted(verdict.silent))), ", ".join(sorted(addresses)))
        try:
            if run.device.type == "cuda":
                dist.distributed_c10d._abort_process_group()
            cut_connections(addresses)
        except Exception as e:
            log.error("rank %d: the collective could not be interrupted (%s: %s)",
                      run.env.rank, type(e).__name__, e)
            return False
        return True

    def recover(self, error: BaseException) -> bool:
        """Go on without the lost ranks, from the newest snapshot all the others hold;
        False (the caller raises ``error``) when this is not a lost peer or recovery
        failed, with the reason in the log. Rank 0 writes its receipt
        (:mod:`gpufleet.fault.receipt`) once the steps after it run at full speed."""
        env = self.run.env
        if not is_peer_loss(error):
            return False
        start, began_t = time.perf_counter(), time.time()
        keeper = self.run.monitors.receipts
        median_step, last_end = keeper.begin() if keeper is not None else (None, None)
        steps_done = self.run.state.step
        detected_by, detection_s = self._detection(error, start, last_end)
        log.warning("rank %d: a collective failed (%s: %s); recovering in process from "
                    "the newest in-memory snapshot", env.rank, type(error).__name__,
                    str(error).splitlines()[0][:200])
        # The failed step's frames hold the old DDP wrapper and the batch: let them go.
        traceback.clear_frames(error.__traceback__)
        self.phases, self.received = {}, []
        try:
            old_world, membership = env.world_size, self._regroup()
            # COLLECTIVE: what each rank saw, for the receipt (one small gather).
            facts = gather_objects(rank_facts(self.run, steps_done, self.received))
        except Exception as e:
            log.error("rank %d: in-process recovery failed (%s: %s); this process ends and "
                      "the elastic agent restarts the ranks from the newest checkpoint "
                      "(with --max-restarts)", env.rank, type(e).__name__, e)
            return False
        went_on = time.perf_counter()
        lost = sorted(set(range(old_world)) - set(membership.ranks))
        log.warning("recovered in-process from the step-%d snapshot, world %d -> %d (rank%s "
                    "%s lost; this rank is now rank %d) in %.2f s; no checkpoint read",
                    membership.step, old_world, len(membership.ranks),
                    "s" if len(lost) > 1 else "", ", ".join(map(str, lost)),
                    self.run.env.rank, went_on - start,
                    extra={"recovered_step": membership.step, "world_size": len(membership.ranks)})
        if keeper is not None and self.run.env.is_main:
            assert membership.step is not None
            samples, _ = replayed(self.run, membership.step, began_t)
            keeper.settle(Receipt(
                "recovery", began_t, membership.step, old_world, len(membership.ranks),
                lost, detected_by, detection_s, dict(self.phases), went_on - start,
                transfers_of(facts, self.run.monitors.links), median_step_s=median_step,
                steps_repeated=max(f["steps"] for f in facts) - membership.step,
                samples_replayed=samples), went_on)
        return True

    def _detection(self, error: BaseException, now: float, last_end: float | None
                   ) -> tuple[str, float | None]:
        """How the loss was detected and how long that took: the watchdog's verdict
        (the silent ranks' time since their last heartbeat, and since the verdict), or
        the failed collective (at most the time since this rank's last step ended)."""
        silent, self._silent = self._silent, None
        if silent is not None and now - silent[0] < self.timeout_s:
            at, ranks, quiet_s = silent
            return (f"the watchdog: rank(s) {', '.join(map(str, ranks))} stopped answering "
                    f"(no heartbeat for {quiet_s:.1f} s)", quiet_s + now - at)
        return (f"a failed collective ({type(error).__name__}: {_gist(str(error))})",
                None if last_end is None else now - last_end)

    # -- the steps -------------------------------------------------------------------
    def _regroup(self) -> Membership:
        run = self.run
        snaps = run.monitors.snapshots
        assert snaps is not None, "recovery is built only with snapshots"
        clock = self._clock()
        own = snaps.snapshotter.own_copy(THREAD_WAIT_S)
        if not snaps.snapshotter.wait(THREAD_WAIT_S):
            raise RecoveryFailed(f"the snapshot exchange still ran after {THREAD_WAIT_S:g} s")
        self.loop.wait()  # a checkpoint written in the background ends first
        # A survivor still blocked on this rank in the failed collective (one not next
        # to the lost rank in the ring) fails at once, as if this rank had gone too, and
        # reports here instead of waiting for its heartbeat timeout.
        cut_old_group(run.monitors.watchdog, self.store)
        leave_groups(run.device)
        held = snaps.snapshotter.held() if self.reshards else \
            ([] if own is None else [Held(run.env.rank, run.env.rank, own.step)])
        clock("leave")
        membership = self._agree(held)
        clock("agree")
        if membership.step is None:
            raise RecoveryFailed("the ranks left hold no in-memory snapshot of one step"
                                 + (" for every shard" if self.reshards else ""))
        new_rank, world = membership.ranks.index(run.env.rank), len(membership.ranks)
        # COLLECTIVE from here on, over the new group, in the same order on every rank.
        dist.init_process_group(
            self.backend, store=dist.PrefixStore(f"{self._keys}/pg", self.store),
            rank=new_rank, world_size=world, timeout=timedelta(seconds=self.timeout_s))
        self.generation += 1
        source = f"the step-{membership.step} in-memory snapshot"
        if self.reshards:  # every shard position's copy joined (old rank and mesh), then
            # the models built again over the new mesh
            clock("regroup")
            state = whole_from_snapshots(membership.sources, membership.ranks,
                                         snaps.snapshotter, membership.step, run.env.rank,
                                         run.strategy.dims, run.device, self.received)
            clock("transfer")
            self.rebuild(new_rank, world)
            clock("regroup")
            self.restore(state, source + "s of every shard")
        else:
            assert own is not None and own.step == membership.step
            self.rebuild(new_rank, world)
            clock("regroup")
            self.restore(own.state(), source)
        clock("restore")
        if run.monitors.preemption is not None:
            run.monitors.preemption.regroup()  # COLLECTIVE where it has a group
        snaps.rejoin(new_rank, world)  # COLLECTIVE: the snapshot ring's new group
        if run.monitors.watchdog is not None:
            run.monitors.watchdog.rejoin(new_rank, world, job_store(), self.generation)
        if self.growing is not None:  # this rank's new place, for a node that joins
            self.growing.say_growable()
        clock("regroup")
        return membership

    def _clock(self) -> Any:
        """A function ``clock(phase)`` that adds the time since its last call (or since
        this one) to ``self.phases[phase]``."""
        last = [time.perf_counter()]

        def clock(phase: str) -> None:
            now = time.perf_counter()
            self.phases[phase] = self.phases.get(phase, 0.0) + now - last[0]
            last[0] = now
        return clock

    @property
    def _keys(self) -> str:
        return f"{self.prefix}/g{self.generation}"

    def _agree(self, held: list[Held]) -> Membership:
        """Report the complete snapshot copies this rank holds to the store; the first
        rank to propose a decision (whoever is lost, rank 0 included) decides who goes on
        from which step (and, for shards, whose copies make it)."""
        env, keys, store = self.run.env, self._keys, self.store
        store.set(f"{keys}/member/{env.rank}",
                  json.dumps({"held": [[h.holder, h.owner, h.step] for h in held]}))
        store.add(f"{keys}/count", 1)
        # Every rank waits for the others' reports (at most the window), then proposes
        # what it saw; the first proposal the store takes is the decision for all.
        deadline = time.monotonic() + self.window_s
        while store.add(f"{keys}/count", 0) < env.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
        present = [r for r in range(env.world_size) if store.check([f"{keys}/member/{r}"])]
        reported = [Held(*h) for r in present
                    for h in json.loads(store.get(f"{keys}/member/{r}"))["held"]]
        assembly = newest_sharded(
            reported, present, [shard_position(r, self.run.strategy.dims)
                                for r in range(env.world_size)]) \
            if self.reshards else newest_replicated(reported, present)
        proposal = json.dumps({"ranks": present,
                               "step": None if assembly is None else assembly.step,
                               "sources": {} if assembly is None else assembly.sources})
        decision = json.loads(store.compare_set(f"{keys}/decision", "", proposal))
        membership = Membership(tuple(decision["ranks"]), decision["step"],
                                {int(k): v for k, v in decision["sources"].items()})
        if env.rank not in membership.ranks:
            raise RecoveryFailed(f"rank {env.rank} reported after another rank closed the "
                                 f"membership {list(membership.ranks)}")
        if len(membership.ranks) == env.world_size:
            raise RecoveryFailed("every rank reported: no rank was lost, so the error "
                                 "is not a lost node")
        fewest = parse_nnodes(self.run.cfg.dist.nnodes)[0]
        nodes_left = -(-len(membership.ranks) // max(env.local_world_size, 1))
        if nodes_left < fewest:
            raise RecoveryFailed(f"{nodes_left} node(s) left, fewer than the {fewest} of "
                                 f"dist.nnodes = {self.run.cfg.dist.nnodes!r}")
        return membership

    def rebuild(self, rank: int, world: int) -> None:
        """Everything that depends on the process group, for this rank's new place."""
        run = self.run
        env = dataclasses.replace(run.env, rank=rank, world_size=world)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        run.env = env
        run.strategy.regroup(world, run.env.local_world_size)  # (hsdp: a node's ranks)
        for part in run.parts:  # COLLECTIVE: DDP checks and broadcasts the parameters
            if self.reshards:  # a fresh module sharded over the new mesh, a new optimizer
                part.model, part.optimizer = part.source.build(run.strategy, run.cfg, world)
                part.scheduler = place_scheduler(part.scheduler, part.optimizer)
                part.params = [p for p in part.model.parameters() if p.requires_grad]
            else:
                part.model = rewrap(part.model, run.strategy, run.device)
        first = run.parts[0]
        run.model, run.optimizer = first.model, first.optimizer
        run.scheduler = first.scheduler
        if run.monitors.arrival is not None:
            run.monitors.arrival.watch(run.model)
        shard, shards = run.strategy.data_shard(rank, world)
        # The loop's own: its data shard, and (COLLECTIVE where sharded writes have a
        # group) its checkpointer
        self.loop.regroup(rank, shard, shards, world // shards)

    def restore(self, held: Any, source: str) -> None:
        """Put a state back (copied out of the snapshot's buffer, which the next snapshot
        overwrites) and the data where it was; ``source`` names it in messages."""
        run = self.run
        for part in run.parts:  # the failed step's gradients
            part.optimizer.zero_grad()
        state = map_tensors(held, lambda t: t.clone())
        step = run.state.step = self.loop.restore(state, source)
        result = run.result  # the steps after the snapshot are trained again
        result.losses = [(s, v) for s, v in result.losses if s <= step]
        result.eval_losses = [(s, v) for s, v in result.eval_losses if s <= step]


def _gist(message: str) -> str:
    """What a backend's error says about the lost peer, short: the first words of
    :data:`_PEER_LOST` it holds and the peer's address (``[10.0.0.2]:8901``), else its
    first line."""
    words = next((w for w in _PEER_LOST[:5] if w in message), "")
    if words:
        found = re.search(r"\[([0-9A-Fa-f.:]+)\]:(\d+)", message)
        tail = re.split(r"\.\s|\n|\s\[", message[message.index(words):])[0][:60]
        return tail.rstrip(". :") + (f", {found.group(1)}:{found.group(2)}" if found else "")
    return message.splitlines()[0][:120] if message else ""


def leave_groups(device: torch.device) -> None:
    """Leave every process group (NCCL's communicators aborted first: a communicator
    with a lost peer may never return otherwise)."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if device.type == "cuda" and abort is not None:
        abort()  # every group let go too
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def rewrap(model: Any, strategy: Strategy, device: torch.device) -> Any:
    """A DDP module made again over the new default group (its old reducer's hooks
    removed); a new rank's module, built without a group, wrapped for the first time."""
    if not isinstance(model, DDP):
        if strategy.traits.data_parallel != "replicate":
            return model
        return replicate(model, strategy.cfg, device)
    try:
        model._remove_autograd_hooks()
    except (AttributeError, RuntimeError) as e:  # an older torch; the wrapper is dropped
        log.debug("the old DDP wrapper's hooks stay until it is collected: %s", e)
    return replicate(model.module, strategy.cfg, device)

