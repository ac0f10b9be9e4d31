"""The data ledger: which samples each rank consumed at which step, kept in the run dir.

Every rank of a run writes one ledger per process under ``RUN_DIR/ledger/``; ``gpufleet
data audit RUN_DIR`` (:mod:`gpufleet.data.audit`) reads them all and proves that every
sample of each finished epoch was consumed exactly once.

What is recorded is positions, not indices. A resumable sampler's order is a function of
its seed and epoch, so a *segment* line names the order once (epoch, seed, dataset
length, the samples of the epoch an earlier run consumed, world size, this rank's shard)
and the rank's consumption in it is a range of positions in its share. Inside a segment a
*span* is a run of consecutive steps that each took the same number of positions: its
line says where it starts (``step0``, ``pos0``), and its progress (the positions of the
first step, of every later one, the last step and the end) lives in a small
memory-mapped *slot* file the rank updates at every batch: a few stores into the page
cache, no system call, no device sync, and a process killed at any moment leaves what
it took on disk (the kernel owns the page cache). A span ends with a ``close`` line.

A restore (a resume from a checkpoint, an in-process recovery from a snapshot) writes an
*event* line: steps after the restored step were trained again, so what the earlier
steps after it consumed does not count. The audit applies that truncation; the ledger
itself is append-only, so replays stay visible.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

LEDGER_DIR = "ledger"
SLOT = struct.Struct("<8q")  # magic, span, first, per_step, last_step, end, step_start, check
SLOT_MAGIC = 0x6C656467  # "ledg"
SLOT_BYTES = 2 * SLOT.size  # two slots written in turn: a torn write leaves the other
_OPENED = itertools.count()  # ledgers of this process (fit may run twice in one)


class StepSource(Protocol):
    """Where the ledger reads the steps done (the run's TrainState)."""

    step: int


def slot_check(values: tuple[int, ...]) -> int:
    """The check word of a slot's values (magic first): a torn write does not match it."""
    magic, span, first, per, last, end, start = values
    return (magic ^ (span + 3 * first + 5 * per + 7 * last + 11 * end + 13 * start)) \
        & 0x7FFF_FFFF_FFFF_FFFF


class DataLedger:
    """This process's ledger: segment, span and event lines, and the slot of the open span.

    The stream calls :meth:`begin` when it starts reading a segment (a new run, a
    resume, a recovery, a regroup: ``event=True``; an epoch that rolls over: ``False``)
    and :meth:`take` for every batch it hands out. The step a batch belongs to is the
    step being trained: ``steps.step + 1``.

    Args:
        folder: ``RUN_DIR/ledger``.
        steps: the run's step counter (read at every batch).
        restart: the agent's restart count (part of an event's identity).
    """

    def __init__(self, folder: Path, steps: StepSource, *, restart: int = 0) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{time.time_ns() // 1_000_000}-{os.getpid()}-{next(_OPENED)}"
        self.path = folder / f"{name}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        slot_path = folder / f"{name}.slot"
        with open(slot_path, "wb") as f:
            f.write(bytes(SLOT_BYTES))
        with open(slot_path, "r+b") as f:
            self._slot = mmap.mmap(f.fileno(), SLOT_BYTES)
        self._steps, self._restart = steps, restart
        self._began = False
        self._last_step = 0  # the highest step this process took data for
        self._segments = self._spans = 0
        self._span: list[int] | None = None  # [id, step0, pos0, first, per, step, start]
        self._pos = 0  # positions of the segment this rank took so far
        self._turn = 0

    def begin(self, segment: dict[str, Any], position: int, *, event: bool,
              world: int, rank: int) -> None:
        """Start a segment at ``position`` of this rank's share (what it took before
        counts as taken); with ``event`` it follows a start, resume or restore."""
        self._close()
        if event:
            step = self._steps.step
            if not self._began:
                kind = "resume" if step > 0 else "start"
            elif step < self._last_step:
                kind = "recovery"  # steps after `step` are trained again
            else:
                kind = "regroup"
            self._began = True
            self._write({"event": kind, "step": step, "world": world, "rank": rank,
                         "restart": self._restart, "t": time.time()})
        self._segments += 1
        self._write({"segment": self._segments, **segment, "start": position})
        self._pos = position

    def take(self, count: int) -> None:
        """The stream handed out a batch of ``count`` positions of the segment."""
        step = self._steps.step + 1
        span = self._span
        if span is None or step != span[5]:
            self._next_step(span, step)
            span = self._span
        self._pos += count
        assert span is not None
        pos, first, per, start = self._pos, span[3], span[4], span[6]
        check = (SLOT_MAGIC ^ (span[0] + 3 * first + 5 * per + 7 * step + 11 * pos
                               + 13 * start)) & 0x7FFF_FFFF_FFFF_FFFF  # slot_check, inline
        self._turn ^= 1
        SLOT.pack_into(self._slot, self._turn * SLOT.size, SLOT_MAGIC, span[0], first, per,
                       step, pos, start, check)

    def _next_step(self, span: list[int] | None, step: int) -> None:
        """The first batch of ``step``: the span goes on if its steps stay alike."""
        if span is not None and step == span[5] + 1:
            used = self._pos - span[6]
            if span[5] == span[1]:
                span[3] = used  # the span's first step
            elif span[4] < 0:
                span[4] = used  # every later step takes as much
            if span[4] < 0 or used == span[4]:
                span[5], span[6] = step, self._pos
                self._last_step = max(self._last_step, step)
                return
            # The step just done took another amount: it starts a span of its own.
            self._close(last=span[5] - 1, end=span[6])
            self._open(span[5], span[6], first=used)
            self._span[5], self._span[6] = step, self._pos  # type: ignore[index]
            return
        self._close()
        self._open(step, self._pos)

    def _open(self, step: int, pos: int, first: int = -1) -> None:
        self._spans += 1
        self._span = [self._spans, step, pos, first, -1, step, pos]
        self._last_step = max(self._last_step, step)
        self._write({"span": self._spans, "segment": self._segments, "step0": step,
                     "pos0": pos, "t": time.time()})

    def _close(self, last: int | None = None, end: int | None = None) -> None:
        span = self._span
        if span is None:
            return
        self._span = None
        if last is None:
            last, end = span[5], self._pos
        first = span[3] if span[3] >= 0 else end - span[2]  # type: ignore[operator]
        self._write({"close": span[0], "first": first, "per_step": span[4],
                     "last_step": last, "end": end})

    def _write(self, record: dict[str, Any]) -> None:
        # One write of one line in append mode: lines of one process never interleave,
        # and a line cut by a crash is the last one (the reader skips it).
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        """Write the open span's close line and let go of the files."""
        if self._fd < 0:
            return
        self._close()
        os.close(self._fd)
        self._fd = -1
        self._slot.close()


def read_slot(path: Path) -> tuple[int, ...] | None:
    """The newer valid slot of a slot file: ``(span, first, per_step, last_step, end,
    step_start)``, or None when none was written (or both are torn)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    best = None
    for turn in range(2):
        chunk = data[turn * SLOT.size:(turn + 1) * SLOT.size]
        if len(chunk) < SLOT.size:
            continue
        *values, check = SLOT.unpack(chunk)
        if values[0] != SLOT_MAGIC or slot_check(tuple(values)) != check:
            continue
        if best is None or (values[1], values[4], values[5]) > (best[1], best[4], best[5]):
            best = values
    return tuple(best[1:]) if best is not None else None


def open_ledger(run_dir: Path, steps: StepSource, sampler: Any, restart: int = 0) -> DataLedger:
    """This rank's ledger under ``run_dir/ledger``. A token-budget sampler's batches are
    recomputed from the samples' lengths, so those are kept there once (the first rank
    to get here writes them, through a temporary name)."""
    folder = Path(run_dir) / LEDGER_DIR
    ledger = DataLedger(folder, steps, restart=restart)
    lengths = getattr(sampler, "lengths", None)
    target = folder / "lengths.npy"
    if lengths is not None and not target.exists():
        tmp = folder / f".lengths-{os.getpid()}.npy"
        np.save(tmp, np.asarray(lengths))
        os.replace(tmp, target)
    return ledger
