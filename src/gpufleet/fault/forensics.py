"""Hang forensics: where each rank is, in collectives and in code, in plain sentences.

When the watchdog sees a stall, every rank that can still run Python writes
``collectives-rank-<R>.json`` into the hang's folder: its ring of last collectives
(:mod:`gpufleet.core.ring`) and the stack of its main thread. Rank 0 merges them
(:func:`merge`) into the hang report, e.g.::

    rank 0 waits in all_reduce #41 (step 5, gradient bucket 0, 644 bytes, for 2.1 s);
    rank 1 last entered #38 (all_reduce, step 4, log) and is at model.py:123 in forward

Ranks that disagree on which collective they are in are named as a mismatch: the same
number with a different operation or bucket, two ranks waiting in different numbers, or
a rank blocked in a collective gpufleet did not record (a user's ``all_reduce`` under
``if rank == 0``) while another waits in one it did.

On NCCL, torch's flight recorder keeps its own record of the device side;
:mod:`gpufleet.fault.flight_recorder` points the report to its dumps.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gpufleet.core.ring import RING, CollectiveRing

log = logging.getLogger(__name__)

# Phases whose collectives belong to the step under way (the others to the step done).
_IN_STEP = {"data", "forward", "backward", "optimizer"}
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_TORCH_DIST = os.path.join("torch", "distributed") + os.sep
_STDLIB = sysconfig.get_paths()["stdlib"]


# -- on each rank: what is written ---------------------------------------------------
def capture(rank: int, ring: CollectiveRing = RING) -> dict[str, Any]:
    """This rank's ring and its main thread's stack (outermost frame first), as plain
    data, with the process group's backend. Called from the watchdog thread while the
    main thread is stuck."""
    backend = ""
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    stack = ([[f.filename, f.lineno, f.name] for f in traceback.extract_stack(frame)]
             if frame is not None else [])
    return {"rank": rank, "pid": os.getpid(), "time": time.time(), "backend": backend,
            "ring": ring.snapshot(), "stack": stack}


def write_capture(folder: Path, data: dict[str, Any]) -> Path:
    """Write one rank's :func:`capture` to ``folder``; returns the file."""
    path = folder / f"collectives-rank-{data['rank']}.json"
    path.write_text(json.dumps(data))
    return path


def read_captures(folder: Path) -> list[dict[str, Any]]:
    """Every rank's capture in ``folder``, in rank order (unreadable files skipped)."""
    found = []
    for path in folder.glob("collectives-rank-*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            log.debug("skipping %s: %s", path, e)
    return sorted(found, key=lambda d: d["rank"])


def ring_lines(snapshot: dict[str, Any], last: int = 8) -> list[str]:
    """The ``last`` collectives of a ring, one line each, for a rank's stack file."""
    lines = [f"collectives: #{snapshot['seq']} entered, up to #{snapshot['done']} "
             "returned"]
    for e in snapshot["entries"][-last:]:
        state = "returned" if e["seq"] <= snapshot["done"] else "not returned"
        lines.append(f"  #{e['seq']} {e['op']} ({_label(e)}): {state}")
    return lines


# -- on rank 0: the sentences ----------------------------------------------------------
def _label(e: dict[str, Any]) -> str:
    """Where a ring entry was made: "step 5, gradient bucket 0" or "step 4, log"."""
    phase = e["phase"]
    parts = ["setup" if phase == "setup" else
             f"step {e['step'] + (1 if phase in _IN_STEP else 0)}"]
    if e["bucket"] >= 0:
        parts.append(f"gradient bucket {e['bucket']}")
    elif phase != "setup":
        parts.append(phase)
    where = ", ".join(parts)
    if e["bytes"] >= 0:
        where += f", {e['bytes']} bytes"
    return where


def _frame(f: list[Any]) -> str:
    return f"{os.path.basename(f[0])}:{f[1]} in {f[2]}"


def _collective_call(stack: list[list[Any]]) -> tuple[str, str] | None:
    """The torch.distributed call the stack is blocked in, and where it was called from
    (None when it is not in one)."""
    for i, f in enumerate(stack):
        if f[0].endswith(_C10D):
            callers = [c for c in stack[:i] if _TORCH_DIST not in c[0]]
            return f[2], (_frame(callers[-1]) if callers else _frame(f))
    return None


def _code_position(stack: list[list[Any]]) -> str:
    """The innermost frame of the program's own code (not torch's, not the standard
    library's), else the innermost frame."""
    if not stack:
        return "an unknown place (no stack was taken)"
    torch_dir = os.sep + "torch" + os.sep
    for f in reversed(stack):
        stdlib = f[0].startswith(_STDLIB) and "-packages" not in f[0]  # not site-packages
        if torch_dir not in f[0] and not stdlib and not f[0].startswith("<"):
            return _frame(f)
    return _frame(stack[-1])


def _waiting(d: dict[str, Any]) -> dict[str, Any] | None:
    """The first collective this rank entered and that has not returned."""
    ring = d["ring"]
    return next((e for e in ring["entries"] if e["seq"] > ring["done"]), None)


@dataclass(frozen=True)
class _Where:
    """Where one rank is: ``kind`` "ring" (waits in recorded collective ``seq``),
    "other" (blocked in a collective gpufleet did not record) or "code" (in none).
    ``text`` follows "rank R", with ``{s}``/``{is_}`` for the verb and ``{for_}`` for
    how long it has waited (since ``since``)."""

    kind: str
    seq: int
    text: str
    since: float | None = None


def _where(d: dict[str, Any]) -> _Where:
    ring, stack = d["ring"], d.get("stack", [])
    wait, call = _waiting(d), _collective_call(stack)
    if wait is not None:
        return _Where("ring", wait["seq"], f"wait{{s}} in {wait['op']} #{wait['seq']} "
                      f"({_label(wait)}{{for_}})", wait["time"])
    last = f"#{ring['seq']}" if ring["seq"] else "no collective yet"
    if call is not None:
        op, at = call
        return _Where("other", ring["seq"], f"{{is_}} blocked in {op} called at {at}, a "
                      f"collective gpufleet did not record (last recorded: {last})")
    if ring["seq"]:
        e = ring["entries"][-1]
        last += f" ({e['op']}, {_label(e)})"
    return _Where("code", ring["seq"],
                  f"last entered {last} and {{is_}} at {_code_position(stack)}")


def _sentences(where: dict[int, _Where], ranks: list[int], now: float) -> str:
    """One clause per distinct position of ``ranks``, ranks at the same one together."""
    groups: dict[tuple[str, int, str], list[int]] = {}
    for r in ranks:
        w = where[r]
        groups.setdefault((w.kind, w.seq, w.text), []).append(r)
    clauses = []
    for (_, _, text), members in groups.items():
        one = len(members) == 1
        since = min((where[r].since for r in members if where[r].since is not None),
                    default=None)
        clauses.append(f"rank {', '.join(map(str, members))} " + text.format(
            s="s" if one else "", is_="is" if one else "are",
            for_="" if since is None else f", for {now - since:.1f} s"))
    return "; ".join(clauses)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["seq"] == b["seq"] and a["op"] == b["op"] and a["bucket"] == b["bucket"]


def _mismatched(captures: list[dict[str, Any]], where: dict[int, _Where]) -> list[int]:
    """The ranks in different collectives from each other (none when they agree): two
    ranks waiting in different recorded collectives, or a rank blocked in one gpufleet
    did not record while another waits in any collective."""
    waits = {d["rank"]: _waiting(d) for d in captures if where[d["rank"]].kind == "ring"}
    others = {r for r, w in where.items() if w.kind == "other"}
    named = set()
    for a in waits:
        for b in waits:
            if a < b and not _same(waits[a], waits[b]):
                named |= {a, b}
    if others and (waits or len(others) > 1):
        named |= others | set(waits)
    return sorted(named)


@dataclass(frozen=True)
class Merged:
    """Every rank's position, merged: ``where`` (one sentence for all ranks),
    ``mismatch`` (a sentence naming ranks in different collectives, or "") and
    ``stuck`` (every rank waits in the same collective, or ""). With a mismatch,
    ``where`` speaks only of the ranks it does not name."""

    where: str
    mismatch: str = ""
    stuck: str = ""


def merge(captures: list[dict[str, Any]], now: float | None = None) -> Merged | None:
    """The hang in sentences from every rank's :func:`capture` (None without any): who
    waits in which collective, who is elsewhere and at which line, and whether the ranks
    disagree on the collective they are in.

    Example:
        >>> ring = lambda seq, done, phase, bucket: {"seq": seq, "done": done, "entries": [
        ...     {"seq": seq, "op": "all_reduce", "bytes": 4, "step": 4, "phase": phase,
        ...      "bucket": bucket, "time": 0.0}]}
        >>> merge([{"rank": 0, "ring": ring(9, 8, "backward", 0), "stack": []},
        ...        {"rank": 1, "ring": ring(8, 8, "log", -1),
        ...         "stack": [["/src/model.py", 12, "forward"]]}], now=2.0).where
        'rank 0 waits in all_reduce #9 (step 5, gradient bucket 0, 4 bytes, for 2.0 s); \
rank 1 last entered #8 (all_reduce, step 4, log, 4 bytes) and is at model.py:12 in forward'
    """
    if not captures:
        return None
    now = time.time() if now is None else now
    where = {d["rank"]: _where(d) for d in captures}
    ranks = sorted(where)
    named = _mismatched(captures, where)
    if named:
        rest = [r for r in ranks if r not in named]
        return Merged(_sentences(where, rest, now) if rest else "",
                      mismatch="Mismatched collectives: " + _sentences(where, named, now) +
                      ". The ranks took different paths through the code: a collective "
                      "under a rank-dependent condition (e.g. `if rank == 0: "
                      "all_reduce(...)`) or in a different order on some ranks. Every rank "
                      "must make the same collectives in the same order.")
    stuck = ""
    if len(ranks) > 1 and all(w.kind == "ring" for w in where.values()):
        stuck = ("Every rank waits in the same collective: the transfer itself is stuck "
                 "(the network or the device), not one rank.")
    return Merged(_sentences(where, ranks, now), stuck=stuck)
