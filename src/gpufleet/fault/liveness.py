"""Who stopped answering: heartbeats over the job's store, apart from who is slow.

A rank that is slow still answers; a rank on a dead or cut-off node does not. Each rank
publishes a heartbeat (a counter and its place in the run) to the job's key-value store
every ``interval_s`` from a thread of its own, whatever the training thread is blocked
in. Rank 0 (which hosts the store, or is a client of it like the others when the store
is served elsewhere) reads them all and notes, on its own clock, when each last
changed: a rank whose heartbeat has not moved for ``timeout_s`` stopped answering.
Every other rank notes when its last store round trip succeeded: one that has not
reached the store for ``timeout_s`` is the one cut off.

A third thread judges (it never touches the network, so a store call that hangs on a
dead link cannot hold it up) and hands a verdict to ``on_lost`` once.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpufleet.fault.procstate import process_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What the liveness check found.

    Attributes:
        silent: Ranks that stopped answering (seen from rank 0), with their last beats.
        cut_off_s: Seconds this rank has not reached the store (0 when it has).
        beats: Every rank's last heartbeat (None: never seen), with ``age_s`` added,
            and ``proc_state`` for a quiet rank whose node answered what its process is
            doing (:func:`gpufleet.fault.procstate.process_state`).
    """

    silent: dict[int, dict[str, Any] | None]
    cut_off_s: float
    beats: list[dict[str, Any] | None]


def side_channel(store: Any) -> Any:
    """A connection of its own to ``store`` (the same keys), for threads that must keep
    talking to the store whatever the training thread does there.

    A ``TCPStore`` client serves one call at a time: while the training thread sits in a
    blocking ``wait`` (a survivor waiting for rank 0's decision after a lost node, say),
    every other call on the same client waits too, and heartbeats held back that way
    look like a rank cut off from the job. ``store`` itself where torch cannot clone it
    (before torch 2.5, or a store type without connections), and None for None.
    """
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except (RuntimeError, NotImplementedError, ValueError) as e:
        log.debug("the store (%s) has no second connection: %s", type(store).__name__, e)
        return store


class Liveness:
    """Heartbeats of one rank; see the module docs.

    Args:
        store: The job's key-value store.
        prefix: Key prefix (per elastic restart).
        rank / world_size: This rank's place in the job.
        beat: Returns this rank's heartbeat payload (JSON-serialisable).
        interval_s: Seconds between heartbeats.
        timeout_s: Seconds of silence after which a rank counts as lost.
        on_lost: Called once, from the judging thread, with the verdict.
    """

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int,
                 beat: Callable[[], dict[str, Any]], interval_s: float, timeout_s: float,
                 on_lost: Callable[[Verdict], None]) -> None:
        self.store, self.prefix = store, prefix
        self.rank, self.world_size = rank, world_size
        self.beat, self.interval_s, self.timeout_s = beat, interval_s, timeout_s
        self.on_lost = on_lost
        self._lock = threading.Lock()
        start = time.monotonic()
        self._last_ok = start  # this rank's last successful store round trip
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it moved)
        self._beats: dict[int, dict[str, Any]] = {}
        self._gaps: dict[int, float] = {}  # rank -> longest time its beat took to move
        self._states: dict[int, str] = {}  # quiet rank -> its process state (its node's)
        self._asked = ""
        self._host = socket.gethostname()
        self._start = start
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat_loop, daemon=True,
                                          name="gpufleet-heartbeat"),
                         threading.Thread(target=self._judge_loop, daemon=True,
                                          name="gpufleet-liveness")]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop beating, and say so: a rank that finished is not a rank that went silent."""
        self._stop.set()
        # The heartbeat thread may sit in a store call on a dead link: do not wait for it,
        # and give the last word a second at most.
        done = threading.Thread(target=self._say_done, daemon=True)
        done.start()
        done.join(timeout=1)
        if self._threads[1].ident is not None:  # started (fit may fail before it)
            self._threads[1].join(timeout=2)

    def _say_done(self) -> None:
        try:
            self.store.set(self._key(self.rank), json.dumps({**self.beat(), "beat": -1,
                                                             "done": True}))
        except Exception as e:
            log.debug("final heartbeat failed: %s", e)

    # -- the heartbeat thread (store I/O) ------------------------------------------------
    def _beat_loop(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            try:
                self.store.set(self._key(self.rank),
                               json.dumps({**self.beat(), "beat": count}))
                if self.rank == 0:
                    self._read_all()
                    self._ask_about_quiet()
                else:
                    self._answer_asks()
                with self._lock:
                    self._last_ok = time.monotonic()
            except Exception as e:  # a dead link: the judge notices the silence
                log.debug("heartbeat to the store failed: %s", e)
            self._stop.wait(self.interval_s)

    def _read_all(self) -> None:
        keys = [self._key(r) for r in range(self.world_size)]
        present = [k for k in keys if self.store.check([k])]
        values = self.store.multi_get(present) if present else []
        now = time.monotonic()
        with self._lock:
            for key, raw in zip(present, values, strict=True):
                beat = json.loads(raw)
                rank = int(key.rsplit("/", 1)[1])
                count, moved = self._seen.get(rank, (None, 0.0))
                if count != beat["beat"]:
                    if count is not None:  # a gap between two beats (not start-up)
                        self._gaps[rank] = max(self._gaps.get(rank, 0.0), now - moved)
                    self._seen[rank] = (beat["beat"], now)
                    self._states.pop(rank, None)
                self._beats[rank] = beat

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/alive/{rank}"

    def limit(self, rank: int) -> float:
        """Seconds of silence after which ``rank`` counts as lost: ``timeout_s``, or
        three times the longest gap its beats showed so far when that is longer (a
        loaded machine, a long checkpoint write holding the interpreter)."""
        return max(self.timeout_s, 3.0 * self._gaps.get(rank, 0.0))

    def _ask_about_quiet(self) -> None:
        """Rank 0: find out what the processes of ranks quiet for a third of their
        limit are doing: read /proc for those on this node; ask the others' nodes
        through the store (:meth:`_answer_asks`), and read what they answered."""
        now = time.monotonic()
        with self._lock:
            quiet = {r: self._beats[r] for r, (_, moved) in self._seen.items()
                     if r != 0 and r in self._beats and not self._beats[r].get("done")
                     and now - moved > self.limit(r) / 3}
        remote = {}
        for r, beat in quiet.items():
            if beat.get("host") == self._host:
                state = process_state(int(beat.get("pid", -1)))
                with self._lock:
                    self._states[r] = state
            else:
                remote[str(r)] = [beat.get("host"), beat.get("pid")]
        asked = json.dumps(remote, sort_keys=True)
        if asked != self._asked:
            self.store.set(f"{self.prefix}/ask", asked)
            self._asked = asked
        for r in remote:
            key = f"{self.prefix}/proc/{r}"
            if self.store.check([key]):
                with self._lock:
                    self._states[int(r)] = self.store.get(key).decode()

    def _answer_asks(self) -> None:
        """Any other rank: answer rank 0's questions about processes on this node."""
        key = f"{self.prefix}/ask"
        if not self.store.check([key]):
            return
        for r, (host, pid) in json.loads(self.store.get(key)).items():
            if host == self._host and int(r) != self.rank:
                self.store.set(f"{self.prefix}/proc/{r}", process_state(int(pid)))

    # -- the judging thread (no I/O) ------------------------------------------------------
    def verdict(self) -> Verdict:
        """The current state: silent ranks (rank 0 only), and this rank's own silence."""
        now = time.monotonic()
        with self._lock:
            beats: list[dict[str, Any] | None] = []
            silent: dict[int, dict[str, Any] | None] = {}
            for r in range(self.world_size):
                _, moved = self._seen.get(r, (None, self._start))
                beat = self._beats.get(r)
                age = now - moved
                extra = {"proc_state": self._states[r]} if r in self._states else {}
                beats.append({**beat, "age_s": age, **extra} if beat else None)
                finished = bool(beat and beat.get("done"))
                if self.rank == 0 and r != 0 and age > self.limit(r) and not finished:
                    silent[r] = beats[-1]
            cut_off = now - self._last_ok
        return Verdict(silent, cut_off if cut_off > self.timeout_s else 0.0, beats)

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            verdict = self.verdict()
            if verdict.silent or verdict.cut_off_s:
                self._stop.set()
                self.on_lost(verdict)
                return
