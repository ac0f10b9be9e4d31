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

On NCCL, torch's flight recorder keeps its own record of each rank's collectives on the
device side; :func:`flight_recorder_files` finds its dumps for the report.
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
from collections.abc import Mapping
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
# Where torch's flight recorder writes its dumps: the variable (newer name first) and
# torch's default prefix; each rank's file is the prefix followed by its rank.
FLIGHT_RECORDER_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
FLIGHT_RECORDER_DEFAULT = "/tmp/nccl_trace_rank_"


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
    if phase == "setup":
        where = "setup"
    else:
        where = f"step {e['step'] + (1 if phase in _IN_STEP else 0)}, "
        where += f"gradient bucket {e['bucket']}" if e["bucket"] >= 0 else phase
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
        if torch_dir not in f[0] and not f[0].startswith(_STDLIB) and \
                not f[0].startswith("<"):
            return _frame(f)
    return _frame(stack[-1])


def _waiting(d: dict[str, Any]) -> dict[str, Any] | None:
    """The first collective this rank entered and that has not returned."""
    ring = d["ring"]
    return next((e for e in ring["entries"] if e["seq"] > ring["done"]), None)


def _position(d: dict[str, Any], now: float) -> tuple[str, str, int | None]:
    """(kind, sentence, number): kind is "ring" (waits in a recorded collective),
    "other" (blocked in a collective gpufleet did not record) or "code" (in no
    collective); number is the recorded collective it waits in, if any."""
    r, ring = d["rank"], d["ring"]
    wait, call = _waiting(d), _collective_call(d.get("stack", []))
    if wait is not None:
        return "ring", (f"rank {r} waits in {wait['op']} #{wait['seq']} ({_label(wait)}, "
                        f"for {now - wait['time']:.1f} s)"), wait["seq"]
    last = (f"#{ring['seq']}" if ring["seq"] else "no collective yet")
    if call is not None:
        op, at = call
        return "other", (f"rank {r} is blocked in {op} called at {at}, a collective "
                         f"gpufleet did not record (its last recorded is {last})"), None
    if ring["seq"]:
        e = ring["entries"][-1]
        last += f" ({e['op']}, {_label(e)})"
    return "code", (f"rank {r} last entered {last} and is at "
                    f"{_code_position(d.get('stack', []))}"), None


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["op"] == b["op"] and a["bucket"] == b["bucket"]


def merge(captures: list[dict[str, Any]], now: float | None = None) -> list[str]:
    """The hang in sentences from every rank's :func:`capture`: first where each rank
    is (who waits in which collective, who is elsewhere and at which line), then, when
    the ranks disagree on the collective they are in, that they took different paths.

    Example:
        >>> ring = lambda seq, done, phase, bucket: {"seq": seq, "done": done, "entries": [
        ...     {"seq": seq, "op": "all_reduce", "bytes": 4, "step": 4, "phase": phase,
        ...      "bucket": bucket, "time": 0.0}]}
        >>> merge([{"rank": 0, "ring": ring(9, 8, "backward", 0), "stack": []},
        ...        {"rank": 1, "ring": ring(8, 8, "log", -1),
        ...         "stack": [["/src/model.py", 12, "forward"]]}], now=2.0)[0]
        'rank 0 waits in all_reduce #9 (step 5, gradient bucket 0, 4 bytes, for 2.0 s); \
rank 1 last entered #8 (all_reduce, step 4, log, 4 bytes) and is at model.py:12 in forward'
    """
    if not captures:
        return []
    now = time.time() if now is None else now
    where = {d["rank"]: _position(d, now) for d in captures}
    lines = ["; ".join(w[1] for w in where.values())]
    mismatch = _mismatch(captures, where)
    if mismatch:
        lines.append(mismatch)
    elif all(w[0] == "ring" for w in where.values()) and len(where) > 1:
        lines.append("Every rank waits in the same collective: the transfer itself is "
                     "stuck (the network or the device), not a rank.")
    return lines


def _mismatch(captures: list[dict[str, Any]],
              where: dict[int, tuple[str, str, int | None]]) -> str:
    """A sentence naming ranks that are in different collectives, or ""."""
    waits = {d["rank"]: _waiting(d) for d in captures if where[d["rank"]][0] == "ring"}
    others = [r for r, w in where.items() if w[0] == "other"]
    pairs: list[tuple[int, int]] = []
    ranks = sorted(waits)
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            ea, eb = waits[a], waits[b]
            if ea and eb and (ea["seq"] != eb["seq"] or not _same(ea, eb)):
                pairs.append((a, b))
    if not pairs and not (others and (waits or len(others) > 1)):
        return ""
    named = sorted({r for p in pairs for r in p} | set(others) |
                   (set(waits) if others else set()))
    return ("Mismatched collectives: " + "; ".join(where[r][1] for r in named) +
            ". The ranks took different paths through the code: a collective under a "
            "rank-dependent condition (e.g. `if rank == 0: all_reduce(...)`) or in a "
            "different order on some ranks. Every rank must make the same collectives "
            "in the same order.")


# -- NCCL's flight recorder ------------------------------------------------------------
def flight_recorder_files(ranks: list[int],
                          environ: Mapping[str, str] | None = None) -> list[Path]:
    """The flight recorder dumps that exist for ``ranks`` (torch writes
    ``<prefix><rank>``, the prefix from :data:`FLIGHT_RECORDER_VARS` or torch's
    default), in rank order.

    Example:
        >>> flight_recorder_files([0, 1], {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/nowhere/t-"})
        []
    """
    environ = os.environ if environ is None else environ
    prefix = next((environ[k] for k in FLIGHT_RECORDER_VARS if environ.get(k)),
                  FLIGHT_RECORDER_DEFAULT)
    return [Path(f"{prefix}{r}") for r in ranks if Path(f"{prefix}{r}").is_file()]


def flight_recorder_note(backend: str, ranks: list[int],
                         environ: Mapping[str, str] | None = None) -> str:
    """What the report says about torch's flight recorder: its dumps on NCCL (or where
    they will appear), nothing on other backends."""
    if backend.lower() != "nccl":
        return ""
    environ = os.environ if environ is None else environ
    found = flight_recorder_files(ranks, environ)
    if found:
        return ("NCCL flight recorder dumps (each rank's last collectives on the device "
                "side; read them with torch's `torchfrtrace`): " +
                ", ".join(map(str, found)))
    size = environ.get("TORCH_FR_BUFFER_SIZE") or environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    if not size or size == "0":
        return ("NCCL flight recorder: off (TORCH_NCCL_TRACE_BUFFER_SIZE is not set); set "
                "it to e.g. 2000 to get each rank's device-side record on a timeout.")
    prefix = next((environ[k] for k in FLIGHT_RECORDER_VARS if environ.get(k)),
                  FLIGHT_RECORDER_DEFAULT)
    return (f"NCCL flight recorder: no dump yet; at the collective timeout each rank "
            f"writes {prefix}<rank> (read them with torch's `torchfrtrace`).")
