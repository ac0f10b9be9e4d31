"""Who stopped answering: heartbeats over the job's store, apart from who is slow.

A rank that is slow still answers; a rank on a dead or cut-off node does not. Each rank
publishes a heartbeat (a counter and its place in the run) to the job's key-value store
every ``interval_s`` from a thread of its own, whatever the training thread is blocked
in. Rank 0, which hosts the store, reads them all and notes, on its own clock, when each
last changed: a rank whose heartbeat has not moved for ``timeout_s`` stopped answering.
Every other rank notes when its last store round trip succeeded: one that has not
reached the store for ``timeout_s`` is the one cut off.

A third thread judges (it never touches the network, so a store call that hangs on a
dead link cannot hold it up) and hands a verdict to ``on_lost`` once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What the liveness check found.

    Attributes:
        silent: Ranks that stopped answering (seen from rank 0), with their last beats.
        cut_off_s: Seconds this rank has not reached the store (0 when it has).
        beats: Every rank's last heartbeat (None: never seen), with ``age_s`` added.
    """

    silent: dict[int, dict[str, Any] | None]
    cut_off_s: float
    beats: list[dict[str, Any] | None]


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
                if self._seen.get(rank, (None, 0.0))[0] != beat["beat"]:
                    self._seen[rank] = (beat["beat"], now)
                self._beats[rank] = beat

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/alive/{rank}"

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
                beats.append({**beat, "age_s": age} if beat else None)
                finished = bool(beat and beat.get("done"))
                if self.rank == 0 and r != 0 and age > self.timeout_s and not finished:
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
