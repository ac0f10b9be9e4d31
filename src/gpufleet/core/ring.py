"""This rank's last collectives, kept in a small preallocated ring for hang reports.

Every collective gpufleet makes (the metrics all-reduce of the log interval, the
non-finite flag, the evaluation totals, the object collectives, barriers, the gradient
norm) and every DDP gradient bucket (through the all-reduce hook that
``gpufleet.monitor.arrival`` registers) notes here its number, operation, bytes, the
step and the phase (or bucket index). Numbers count collectives entered in this process
since it started, so on ranks that took the same path the same number names the same
collective; a rank that made one more or one fewer shows it by its numbers.

A record writes seven slots of fixed lists (no list grows, nothing is built per call
but the integers and the float clock reading themselves); when a hang is seen the
watchdog takes :meth:`CollectiveRing.snapshot` and ``gpufleet.fault.forensics`` turns
the snapshots of every rank into sentences.

"Returned" means the call came back on this host: for gpufleet's own (blocking)
collectives right after the call, for DDP's buckets at the end of backward (DDP waits
for all of them there). On NCCL a collective that returned may still run on the device;
torch's flight recorder has that side.
"""

from __future__ import annotations

import time
from typing import Any

#: How many collectives each rank remembers.
RING_SIZE = 64


class CollectiveRing:
    """A fixed-size record of the last collectives (see the module docs).

    Args:
        size: how many collectives it remembers.

    Example:
        >>> ring = CollectiveRing(4)
        >>> n = ring.enter("all_reduce", 16)
        >>> ring.leave(n)
        >>> ring.snapshot()["entries"][0]["op"], ring.snapshot()["done"]
        ('all_reduce', 1)
    """

    def __init__(self, size: int = RING_SIZE) -> None:
        self.size = size
        self.seq = 0  # the number of the last collective entered
        self.done = 0  # every collective up to this number has returned
        self.step = 0  # steps done (read from ``view`` at each collective and snapshot)
        self.phase = "setup"  # the current phase (likewise)
        #: the run's read-only view (``step``, ``phase``), set by the watchdog; None: the
        #: step and phase stay as last set
        self.view: Any = None
        self._op = [""] * size
        self._bytes = [0] * size
        self._step = [0] * size
        self._phase = [""] * size
        self._bucket = [-1] * size
        self._time = [0.0] * size

    def enter(self, op: str, nbytes: int, bucket: int = -1) -> int:
        """Note that this rank enters collective ``op`` moving ``nbytes`` (-1: unknown),
        for DDP gradient bucket ``bucket`` (-1: not a bucket). Returns its number."""
        self._follow()
        self.seq = n = self.seq + 1
        i = n % self.size
        self._op[i] = op
        self._bytes[i] = nbytes
        self._step[i] = self.step
        self._phase[i] = self.phase
        self._bucket[i] = bucket
        self._time[i] = time.time()
        return n

    def leave(self, n: int) -> None:
        """Collective ``n`` (and, collectives being ordered, every one before) returned."""
        if n > self.done:
            self.done = n

    def leave_all(self) -> None:
        """Every collective entered so far returned (DDP's buckets at backward's end)."""
        self.done = self.seq

    def _follow(self) -> None:
        """Take the run's step and phase as they are now (from ``view``, if set)."""
        view = self.view
        if view is not None:
            self.step, self.phase = view.step, view.phase

    def snapshot(self) -> dict[str, Any]:
        """The ring as plain data, oldest collective first: ``seq`` (last entered),
        ``done`` (returned up to), ``step``, ``phase`` and ``entries``, each with
        ``seq``, ``op``, ``bytes``, ``step``, ``phase``, ``bucket`` and ``time``."""
        self._follow()
        last = self.seq
        entries = []
        for n in range(max(1, last - self.size + 1), last + 1):
            i = n % self.size
            entries.append({"seq": n, "op": self._op[i], "bytes": self._bytes[i],
                            "step": self._step[i], "phase": str(self._phase[i]),
                            "bucket": self._bucket[i], "time": self._time[i]})
        return {"seq": last, "done": self.done, "step": self.step,
                "phase": str(self.phase), "entries": entries}


#: This process's ring (one process is one rank).
RING = CollectiveRing()
