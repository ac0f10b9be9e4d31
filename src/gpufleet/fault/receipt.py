"""A receipt for every recovery and every restart: where its time went, what it cost.

One :class:`Receipt` is kept per event that changed who trains or where training went
on from: an in-process recovery after a lost node (``recovery``), a node joining the
live ranks (``join``) and a restart by the elastic agent from a checkpoint
(``restart``). Rank 0 appends it as one JSON line to ``RUN_DIR/recoveries.jsonl``
(:func:`append_receipt`), logs it as one line (:meth:`Receipt.line`), and report.html
lists it (:func:`read_receipts`).

A receipt holds:

* what happened: the kind, the world size before and after, the ranks lost (or joined);
* how the loss was detected (a collective that failed, the watchdog's verdict that ranks
  went silent, a restart, a node that asked to join) and how long that took;
* the time of each phase of the recovery (:data:`PHASES`, in their order), which sum to
  no more than ``total_s``, the time from the error to training going on;
* each state transfer a rank received (bytes, from which rank, over which interface, in
  how many seconds), judged against the link probe's figure for that pair of nodes
  (:func:`judge_transfer`);
* the re-warm: the time from going on to the end of the first step at full speed (a step
  within :data:`FULL_SPEED` times the median step before the loss);
* the steps trained again and the samples read again (from the data ledger);
* for a restart, the checkpoint read (its path, bytes and seconds).

Example:
    >>> judge_transfer(64 << 20, 2.0, link_mb_s=1000.0, latency_ms=0.2)[0]
    'far below the link'
    >>> judge_transfer(64 << 20, 0.08, link_mb_s=1000.0, latency_ms=0.2)[0]
    'at link speed'
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RECEIPTS_FILE = "recoveries.jsonl"
KINDS = ("recovery", "join", "restart")
#: The phases of a receipt, in the order they run. leave: the snapshot thread and the
#: background checkpoint awaited, the old process group left; agree: the survivors'
#: reports and their decision in the store; regroup: the new process group and what
#: depends on it (strategy, DDP wrappers, data shards, snapshot ring, watchdog);
#: transfer: state sent between ranks; restore: the state put back; read: a
#: checkpoint read from disk (a restart).
PHASES = ("leave", "agree", "regroup", "transfer", "restore", "read")
#: A transfer is "far below the link" when it ran at under this share of the rate the
#: link probe predicts for as many bytes (its round trip plus the bytes at its rate).
FAR_BELOW_SHARE = 0.25
#: Transfers smaller than this are not judged: their time is mostly fixed costs (the
#: probe's own largest message is 1 MiB).
MIN_JUDGED_BYTES = 1 << 20
#: A step is at full speed when it takes at most this many times the median step
#: before the loss.
FULL_SPEED = 1.5


@dataclass
class Transfer:
    """One state transfer a rank received during a recovery or a join.

    Attributes:
        rank: the receiving rank (in the new world).
        peer: the sending rank (in the new world).
        bytes: the payload's size.
        seconds: the time the payload took to arrive (its length sent first, not timed).
        interface: the network interface this rank's process group talks over ("" when
            unknown).
        link_mb_s: the link probe's rate for this pair of nodes, one direction, MB/s
            (None: no probe of this pair).
        latency_ms: the probe's round trip for the pair (None: no probe).
        verdict: :func:`judge_transfer`'s word; ``why``: its sentence.
    """

    rank: int
    peer: int
    bytes: int
    seconds: float
    interface: str = ""
    link_mb_s: float | None = None
    latency_ms: float | None = None
    verdict: str = ""
    why: str = ""

    @property
    def mb_s(self) -> float:
        """The measured rate, MB/s (10^6 bytes a second)."""
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def judged(self) -> Transfer:
        """This transfer with its verdict filled in."""
        self.verdict, self.why = judge_transfer(self.bytes, self.seconds, self.link_mb_s,
                                                self.latency_ms)
        return self


def judge_transfer(nbytes: int, seconds: float, link_mb_s: float | None,
                   latency_ms: float | None) -> tuple[str, str]:
    """Whether a transfer of ``nbytes`` in ``seconds`` ran at the speed the link probe
    measured (``link_mb_s`` one way, ``latency_ms`` a round trip): ``("far below the
    link", why)`` when it reached under :data:`FAR_BELOW_SHARE` of the rate the probe
    predicts for as many bytes, ``("at link speed", why)`` otherwise, and ``("not
    judged", why)`` for transfers under :data:`MIN_JUDGED_BYTES`, without a probe of
    the pair, or without a time."""
    if nbytes < MIN_JUDGED_BYTES:
        return "not judged", (f"{nbytes:,} bytes, under the {MIN_JUDGED_BYTES >> 20} MiB a "
                              "transfer needs to be judged against the link")
    if not link_mb_s or latency_ms is None:
        return "not judged", "no link probe of this pair of nodes"
    if seconds <= 0:
        return "not judged", "no time measured"
    expected = latency_ms / 1e3 + nbytes / (link_mb_s * 1e6)
    share = expected / seconds
    measured = nbytes / seconds / 1e6
    if share < FAR_BELOW_SHARE:
        return "far below the link", (
            f"{measured:,.1f} MB/s, {share:.0%} of the {link_mb_s:,.1f} MB/s the link probe "
            f"measured (under {FAR_BELOW_SHARE:.0%}): the state went another way than the "
            "probed link (another interface, a shared or shaped route) or the link "
            "slowed down since the start")
    return "at link speed", (f"{measured:,.1f} MB/s, {share:.0%} of the link probe's "
                             f"{link_mb_s:,.1f} MB/s")


@dataclass
class Receipt:
    """What one recovery, join or restart cost (see the module docs).

    Attributes:
        kind: one of :data:`KINDS`.
        t: wall-clock time (``time.time()``) when it began.
        step: the step training went on from.
        world_from: the world size before it; ``world_to``: after.
        ranks: the old ranks lost (recovery), the new ranks (join); empty for a restart.
        detected_by: how it was detected ("a failed collective: ...", "the watchdog:
            ...", "the elastic agent's restart", "a node asked to join").
        detection_s: the time from the loss to its detection, or an upper bound (see
            the docs; None: not known).
        phases: seconds per phase of :data:`PHASES` that ran, in that order.
        total_s: seconds from the error (or the start) to training going on.
        transfers: the state transfers ranks received.
        rewarm_s: seconds from going on to the end of the first step at full speed
            (None: none was reached before the run ended).
        rewarm_steps: the steps that took, that one included.
        median_step_s: the median step before the loss (the full-speed reference).
        steps_repeated: steps finished before it that are trained again.
        samples_replayed: samples read before it (in those steps) that are read again,
            from the run's data ledger (None: no ledger).
        checkpoint: for a restart, ``{"path", "bytes", "seconds"}`` of the read.
        notes: anything else worth saying (a fallback, a partial view).
    """

    kind: str
    t: float
    step: int
    world_from: int
    world_to: int
    ranks: list[int] = field(default_factory=list)
    detected_by: str = ""
    detection_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    transfers: list[Transfer] = field(default_factory=list)
    rewarm_s: float | None = None
    rewarm_steps: int | None = None
    median_step_s: float | None = None
    steps_repeated: int = 0
    samples_replayed: int | None = None
    checkpoint: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"receipt kind {self.kind!r} is not one of {', '.join(KINDS)}")
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown:
            raise ValueError(f"receipt phase(s) {unknown} not among {', '.join(PHASES)}")

    def to_json(self) -> str:
        """One JSON line (no newline)."""
        record = asdict(self)
        for out, transfer in zip(record["transfers"], self.transfers):
            out["mb_s"] = round(transfer.mb_s, 3)
        return json.dumps(record, separators=(",", ":"))

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Receipt:
        """A receipt from its JSON form (fields it does not know are left out)."""
        known = {k: v for k, v in record.items() if k in cls.__dataclass_fields__}
        known["transfers"] = [Transfer(**{k: v for k, v in t.items()
                                          if k in Transfer.__dataclass_fields__})
                              for t in record.get("transfers") or []]
        return cls(**known)

    @property
    def far_below(self) -> list[Transfer]:
        """The transfers judged far below their link."""
        return [t for t in self.transfers if t.verdict == "far below the link"]

    def event(self) -> str:
        """What happened where: "recovery at step 7", "restart from step 6"."""
        return (f"restart from step {self.step}" if self.kind == "restart"
                else f"{self.kind} at step {self.step}")

    def detection(self) -> str:
        """How the event was detected and how long that took ("" when not recorded)."""
        if not self.detected_by:
            return ""
        return self.detected_by + (f" after {self.detection_s:.2f} s"
                                   if self.detection_s is not None else "")

    def line(self) -> str:
        """The receipt as one log line."""
        head = self.event()
        who = ""
        if self.ranks:
            word = "joined" if self.kind == "join" else "lost"
            who = f"; rank{'s' if len(self.ranks) > 1 else ''} " \
                  f"{', '.join(map(str, self.ranks))} {word}"
        detected = f"detected by {self.detection()}" if self.detected_by else \
            (f" after {self.detection_s:.2f} s" if self.detection_s is not None else "")
        phases = ", ".join(f"{name} {s:.2f} s" for name, s in self.phases.items())
        parts = [f"receipt: {head}, world {self.world_from} -> {self.world_to}{who}"
                 + (f" ({detected})" if detected else ""),
                 f"{phases} of {self.total_s:.2f} s" if phases else
                 f"{self.total_s:.2f} s"]
        if self.checkpoint:
            parts.append(f"read {self.checkpoint.get('bytes', 0):,} bytes of "
                         f"{Path(str(self.checkpoint.get('path', '?'))).name} in "
                         f"{self.checkpoint.get('seconds', 0.0):.2f} s")
        for t in self.transfers:
            parts.append(f"{t.bytes:,} bytes rank {t.peer} -> {t.rank} over "
                         f"{t.interface or '?'} in {t.seconds:.3f} s ({t.mb_s:,.1f} MB/s; "
                         f"{t.verdict or 'not judged'})")
        if not self.transfers and self.kind != "restart":
            parts.append("no state sent between ranks")
        parts.append(f"re-warm {self.rewarm_s:.2f} s ({self.rewarm_steps} step(s))"
                     if self.rewarm_s is not None else "re-warm not reached")
        replayed = "?" if self.samples_replayed is None else f"{self.samples_replayed:,}"
        parts.append(f"{self.steps_repeated} step(s) repeated, {replayed} sample(s) "
                     "replayed")
        parts += self.notes
        return "; ".join(parts)


def append_receipt(run_dir: str | Path, receipt: Receipt) -> Path:
    """Append ``receipt`` to ``RUN_DIR/recoveries.jsonl`` (one write of one line in
    append mode: a crash cuts at most the last line). Returns the file's path."""
    path = Path(run_dir) / RECEIPTS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (receipt.to_json() + "\n").encode())
    finally:
        os.close(fd)
    return path


def read_receipts(run_dir: str | Path) -> list[Receipt]:
    """The receipts of a run, oldest first (a line cut by a crash is skipped)."""
    path = Path(run_dir) / RECEIPTS_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(Receipt.from_dict(json.loads(line)))
        except (ValueError, TypeError):
            continue
    return out
