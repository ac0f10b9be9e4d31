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

A rank that dies inside a collective (gloo aborts the process on a mismatch; a
segfault) runs no Python after it, so the ring is also kept in a file
(:meth:`CollectiveRing.attach`): a shared memory map of ``<run_dir>/crash/ring-rank-R.bin``
that each :meth:`~CollectiveRing.enter` writes its record into before the call is made
(a ``struct.pack_into``, no system call; the kernel keeps the pages when the process
dies). :func:`read_ring_file` reads it back as :meth:`~CollectiveRing.snapshot` would.
A collective your own code issues (``Fleet.all_reduce``) also notes where it was
called (``site``, "train.py:42").
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

#: How many collectives each rank remembers.
RING_SIZE = 64

# The file: a header (magic, size, seq at attach, done, rank, pid), then ``size``
# records; the last entered is the record with the highest seq (one write per enter).
_MAGIC = b"GFRING1\0"
_HEADER = struct.Struct("<8sqqqqq")
_RECORD = struct.Struct("<qqqqd24s16s64s")  # seq bytes step bucket time op phase site
_DONE_AT = 24


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
        self._site = [""] * size
        #: where your own code called the collective being entered ("train.py:42"), set
        #: by the caller just before :meth:`enter` (Fleet's collectives); "" otherwise
        self.site = ""
        self._map: mmap.mmap | None = None

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
        self._time[i] = now = time.time()
        self._site[i] = site = self.site
        if self._map is not None:  # before the call: a rank dying in it leaves this
            _RECORD.pack_into(self._map, _HEADER.size + i * _RECORD.size, n, nbytes,
                              self.step, bucket, now, op.encode(), self.phase.encode(),
                              site.encode())  # its seq says it is the last one
        return n

    def leave(self, n: int) -> None:
        """Collective ``n`` (and, collectives being ordered, every one before) returned."""
        if n > self.done:
            self.done = n
            if self._map is not None:
                struct.pack_into("<q", self._map, _DONE_AT, n)

    def leave_all(self) -> None:
        """Every collective entered so far returned (DDP's buckets at backward's end)."""
        self.leave(self.seq)

    def attach(self, path: str | Path, rank: int) -> None:
        """Keep the ring in file ``path`` too (see the module docs), from what it holds
        now on; a ring attached elsewhere before moves."""
        self.detach()
        size = _HEADER.size + self.size * _RECORD.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the map holds the file
        _HEADER.pack_into(self._map, 0, _MAGIC, self.size, self.seq, self.done, rank,
                          os.getpid())
        for n in range(max(1, self.seq - self.size + 1), self.seq + 1):
            i = n % self.size
            _RECORD.pack_into(self._map, _HEADER.size + i * _RECORD.size, n,
                              self._bytes[i], self._step[i], self._bucket[i],
                              self._time[i], self._op[i].encode(),
                              str(self._phase[i]).encode(), self._site[i].encode())

    def detach(self) -> None:
        """Stop writing to the file (it stays, as last written)."""
        if self._map is not None:
            self._map.close()
            self._map = None

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
                            "bucket": self._bucket[i], "time": self._time[i],
                            "site": self._site[i]})
        return {"seq": last, "done": self.done, "step": self.step,
                "phase": str(self.phase), "entries": entries}


# gpufleet's own code (this package's folder) and torch's: not the program's.
_LIBRARY = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
            os.sep + "torch" + os.sep)


def call_site() -> str:
    """Where the program's own code called into gpufleet: "train.py:42" for the
    innermost frame outside gpufleet and torch ("" if none). A few frame reads: for
    the collectives your own loop calls (Fleet's), not per gradient bucket."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in _LIBRARY):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def read_ring_file(path: str | Path) -> dict[str, Any] | None:
    """A ring file written by :meth:`CollectiveRing.attach`, as a snapshot (with
    ``rank`` and ``pid``; the step and phase are those of its last entry); None when
    it cannot be read or is not one."""
    try:
        data = Path(path).read_bytes()
        magic, size, last, done, rank, pid = _HEADER.unpack_from(data)
    except (OSError, struct.error):
        return None
    if magic != _MAGIC or len(data) < _HEADER.size + size * _RECORD.size:
        return None
    records = [_RECORD.unpack_from(data, _HEADER.size + i * _RECORD.size)
               for i in range(size)]
    last = max([last, *(r[0] for r in records)])
    entries = []
    for seq, nbytes, step, bucket, at, op, phase, site in sorted(records):
        if seq > max(0, last - size):  # unwritten slots hold 0
            entries.append({"seq": seq, "op": _text(op), "bytes": nbytes, "step": step,
                            "phase": _text(phase), "bucket": bucket, "time": at,
                            "site": _text(site)})
    tail = entries[-1] if entries else {"step": 0, "phase": "setup"}
    return {"seq": last, "done": done, "step": tail["step"], "phase": tail["phase"],
            "entries": entries, "rank": rank, "pid": pid}


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


#: This process's ring (one process is one rank).
RING = CollectiveRing()
