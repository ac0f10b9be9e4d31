"""Where each rank was when one died: its last collectives and code, in one sentence.

Every rank with peers keeps its ring of last collectives in a file and its Python
stacks for a fatal signal (:mod:`gpufleet.fault.fatal`). After a failure, rank 0's
crash report and the launcher read those of every rank on the node and merge them
(:func:`positions`), e.g.::

    collective mismatch: rank 1 entered all_reduce #13 (4 bytes, step 5, train.py:42)
    while rank 0 was in all_reduce #13 (gradient bucket 0, 67588 bytes, step 6)

A rank's position is the first collective it entered and that did not return; ranks
in different collectives took different paths through the code.
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.core.ring import read_ring_file
from gpufleet.fault.forensics import _IN_STEP

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>\S+)')
_LIBRARY = (os.sep + "torch" + os.sep,  # torch's code and gpufleet's are not the program's
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)
_STDLIB = sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class RankFiles:
    """What one rank left: ``ring`` (a snapshot, or None), ``stacks`` (its fatal-signal
    stacks file when written, else None) and ``at`` (the innermost frame of your code
    in them, "train.py:42 in <module>", or "")."""

    rank: int
    ring: dict[str, Any] | None
    stacks: Path | None = None
    at: str = ""


def read_folder(folder: Path) -> dict[int, RankFiles]:
    """Every rank's files in one crash folder (``ring-rank-R.bin``, ``fatal-rank-R.txt``)."""
    found = {}
    for path in folder.glob("ring-rank-*.bin"):
        rank = int(path.stem.rsplit("-", 1)[1])
        stacks = folder / f"fatal-rank-{rank}.txt"
        text = _read(stacks)
        found[rank] = RankFiles(rank, read_ring_file(path), stacks if text else None,
                                _own_frame(text))
    return found


def read_folders(folders: list[Path]) -> dict[int, RankFiles]:
    """:func:`read_folder` over several folders (a rank found twice: its first)."""
    found: dict[int, RankFiles] = {}
    for folder in folders:
        for rank, files in read_folder(folder).items():
            found.setdefault(rank, files)
    return found


def positions(ranks: dict[int, RankFiles]) -> list[str]:
    """The lines that say where the ranks were: the merged sentence (a collective
    mismatch, or who was in which collective), then each fatal-signal stack file.
    Empty when fewer than two rings were read."""
    rings = {r: f.ring for r, f in ranks.items() if f.ring is not None}
    if len(rings) < 2:
        return []
    died = {r for r, f in ranks.items() if f.stacks is not None}
    lines = [sentence(rings, died)]
    for r, f in sorted(ranks.items()):
        if f.stacks is not None:
            at = f" (your code: {f.at})" if f.at else ""
            lines.append(f"rank {r} died by a fatal signal; its Python stacks at that "
                         f"moment are in {f.stacks}{at}")
    return lines


def sentence(rings: dict[int, dict[str, Any]], died: set[int] = frozenset()) -> str:
    """One sentence for every rank's position; ``died``: the ranks that died by a
    signal, named first.

    Example:
        >>> e = lambda seq, bucket, nbytes, site: {"seq": seq, "op": "all_reduce",
        ...     "bytes": nbytes, "step": 5, "phase": "backward" if bucket >= 0 else "end",
        ...     "bucket": bucket, "time": 0.0, "site": site}
        >>> sentence({0: {"seq": 13, "done": 12, "entries": [e(13, 0, 67588, "")]},
        ...           1: {"seq": 13, "done": 12, "entries": [e(13, -1, 4, "train.py:42")]}},
        ...          died={1})
        'collective mismatch: rank 1 entered all_reduce #13 (4 bytes, step 5, train.py:42) \
while rank 0 was in all_reduce #13 (gradient bucket 0, 67588 bytes, step 6)'
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r in sorted(rings, key=lambda r: (r not in died, r)):
        pending = _pending(rings[r])
        key = (None,) if pending is None else (pending["seq"], pending["op"],
                                               pending["bytes"], pending["bucket"])
        groups.setdefault(key, []).append(r)
    clauses = []  # (who, what)
    for i, members in enumerate(groups.values()):
        pending = _pending(rings[members[0]])
        who = f"rank {', '.join(map(str, members))}"
        one = len(members) == 1
        if pending is None:
            last = rings[members[0]]["entries"][-1:] or [None]
            tail = (f"last entered #{last[0]['seq']} ({last[0]['op']}, {_label(last[0])})"
                    if last[0] else "had entered no collective")
            clauses.append((who, f"{'was' if one else 'were'} in no collective ({tail})"))
        else:
            verb = "entered" if i == 0 else ("was in" if one else "were in")
            clauses.append((who, f"{verb} {pending['op']} #{pending['seq']} "
                                 f"({_label(pending)})"))
    if len(groups) == 1:
        return "every rank " + clauses[0][1]
    in_collectives = sum(1 for key in groups if key != (None,))
    head = "collective mismatch: " if in_collectives > 1 else ""
    text = [" ".join(c) for c in clauses]
    return head + text[0] + " while " + "; ".join(text[1:])


def _pending(ring: dict[str, Any]) -> dict[str, Any] | None:
    """The first collective the ring entered that did not return."""
    return next((e for e in ring["entries"] if e["seq"] > ring["done"]), None)


def _label(e: dict[str, Any]) -> str:
    """"gradient bucket 0, 67588 bytes, step 6" or "4 bytes, step 5, train.py:42"."""
    phase = e["phase"]
    parts = [f"gradient bucket {e['bucket']}"] if e["bucket"] >= 0 else []
    if e["bytes"] >= 0:
        parts.append(f"{e['bytes']} bytes")
    parts.append("setup" if phase == "setup" else
                 f"step {e['step'] + (1 if phase in _IN_STEP else 0)}")
    if e.get("site"):
        parts.append(e["site"])
    elif e["bucket"] < 0 and phase not in ("setup", *_IN_STEP):
        parts.append(phase)
    return ", ".join(parts)


def _own_frame(text: str) -> str:
    """The innermost frame of the program's own code in faulthandler's output: in the
    thread the signal hit if it ran Python, else in the first thread that is in the
    program's code (gloo aborts from a thread of its own, with no Python frames)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    blocks.sort(key=lambda b: not b.startswith("Current thread"))
    for block in blocks:
        for line in block.splitlines():  # most recent call first
            m = _FRAME.match(line)
            if m and _own(m["file"]):
                return f"{os.path.basename(m['file'])}:{m['line']} in {m['name']}"
    return ""


def _own(path: str) -> bool:
    """Whether ``path`` is the program's code: not torch's, gpufleet's or Python's."""
    stdlib = path.startswith(_STDLIB) and "-packages" not in path
    return not stdlib and not path.startswith("<") and \
        not any(part in path for part in _LIBRARY)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
