"""``gpufleet data audit RUN_DIR``: every sample of each finished epoch consumed once.

The audit reads every ledger of the run (:mod:`gpufleet.data.ledger`), keeps what
counts (a restore voids what the steps after the restored one consumed before it),
turns each rank's ranges of positions into positions of the epoch's order (the sampler's
rule: rank ``r`` of ``w`` takes ``skip + k * w + r``; a stream's share takes chunk ``r``
of every row of ``w`` chunks, :func:`epoch_positions`), and counts them:

* a finished epoch (the run read on into a later one, or to the end of this one)
  passes when each of its positions was consumed exactly once. Positions past the
  dataset's end are the sampler's padding (indices repeated so ranks read alike) and the
  samples a loader's ``drop_last`` leaves at the end of each rank's share are left out
  by design: both are counted and named, not failed.
* an epoch under way passes when none of its positions was consumed twice and none
  was skipped: every position below where all ranks have read to (and below where a
  resumed segment starts) was consumed.

A failure names the sample indices (recomputed from the order's seed), the step and
rank that consumed each duplicate, and the event (start, resume, recovery, regroup) its
segment followed.

A stream (an ``IterableDataset``) has no length: its positions are its items' places in
the pass, and an epoch is checked up to the furthest item read (a short last row the
ranks left out, logged by the run, is not in the ledger).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpufleet.data.bucket import BucketBatchSampler
from gpufleet.data.ledger import LEDGER_DIR, read_slot

EVENT_WINDOW_S = 120.0  # copies of one event (one per rank) fall within this of each other
NAMED = 20  # indices named in a line


@dataclass
class Span:
    """Consecutive steps of one segment on one rank, each taking alike."""

    file: str
    order: int  # its place among the file's lines
    segment: dict[str, Any]
    step0: int
    pos0: int
    t: float
    first: int = 0
    per_step: int = -1
    last_step: int = -1
    end: int = 0
    after: str = "start"  # the event its segment followed
    cut: float = math.inf  # steps after this one do not count (a later restore)

    def end_at(self, step: float) -> int:
        """The segment position this span reached at the end of ``step``."""
        if step >= self.last_step:
            return self.end
        if step < self.step0:
            return self.pos0
        taken = self.first + (int(step) - self.step0) * max(self.per_step, 0)
        return min(self.end, self.pos0 + taken)

    def step_of(self, pos: int) -> int:
        """The step that took segment position ``pos`` of this span."""
        if pos < self.pos0 + self.first or self.per_step <= 0:
            return self.step0
        return min(self.last_step, self.step0 + 1 + (pos - self.pos0 - self.first)
                   // self.per_step)


@dataclass
class Event:
    kind: str
    step: int
    world: int
    t: float
    restart: int = 0

    def describe(self) -> str:
        return f"{self.kind} at step {self.step} ({self.world} rank(s))"


@dataclass
class EpochReport:
    epoch: int
    finished: bool
    samples: int  # positions of the order that hold real samples
    once: int = 0
    padding: int = 0
    dropped: list[int] = field(default_factory=list)  # left out by the loader's drop_last
    problems: list[str] = field(default_factory=list)


@dataclass
class AuditReport:
    """What :func:`audit` found: one report per epoch, and whether all passed."""

    epochs: list[EpochReport]
    ledgers: int
    events: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(not e.problems for e in self.epochs) and bool(self.epochs)

    def lines(self) -> list[str]:
        """The report as the CLI prints it."""
        out = [f"{self.ledgers} ledger(s); events: {', '.join(self.events) or 'none'}"]
        for e in self.epochs:
            state = "finished" if e.finished else "under way"
            head = (f"epoch {e.epoch} ({state}): {e.once} of {e.samples} samples consumed "
                    f"once" + (f", {e.padding} padding repeat(s)" if e.padding else "")
                    + (f", {len(e.dropped)} left out by drop_last" if e.dropped else ""))
            out.append(("FAIL " if e.problems else "ok   ") + head)
            out += [f"     {p}" for p in e.problems]
        out += self.notes
        if not self.epochs:
            out.append("FAIL the ledger records no consumed sample")
        return out


def _names(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:NAMED]))
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > NAMED else "")


def _read_file(path: Path) -> tuple[list[Span], list[tuple[int, dict[str, Any]]]]:
    """A ledger file's spans (finished from their close line or the slot) and events."""
    segments: dict[int, dict[str, Any]] = {}
    spans: dict[int, Span] = {}
    events: list[tuple[int, dict[str, Any]]] = []
    after = "start"
    for order, line in enumerate(path.read_text().splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if "event" in rec:
            events.append((order, rec))
            after = f"{rec['event']} at step {rec['step']} ({rec['world']} rank(s))"
        elif "segment" in rec and "span" not in rec:
            segments[rec["segment"]] = rec
        elif "span" in rec:
            spans[rec["span"]] = Span(path.name, order, segments[rec["segment"]],
                                      rec["step0"], rec["pos0"], rec["t"], after=after,
                                      last_step=rec["step0"], end=rec["pos0"])
        elif "close" in rec and rec["close"] in spans:
            s = spans[rec["close"]]
            s.first, s.per_step = rec["first"], rec["per_step"]
            s.last_step, s.end = rec["last_step"], rec["end"]
    slot = read_slot(path.with_suffix(".slot"))
    if slot is not None and slot[0] in spans:
        s = spans[slot[0]]
        if slot[3] >= s.last_step and slot[4] >= s.end:  # newer than a close line
            _, first, s.per_step, s.last_step, s.end, start = slot
            s.first = first if first >= 0 else start - s.pos0 if s.last_step > s.step0 \
                else s.end - s.pos0
    return list(spans.values()), events


def _events(files: dict[str, list[tuple[int, dict[str, Any]]]]
            ) -> list[tuple[Event, dict[str, int]]]:
    """One event per restore, however many ranks wrote it: copies with the same step,
    world size and restart count within EVENT_WINDOW_S. Returns each with the place of
    its copy in each file that holds one."""
    copies = sorted(((rec["t"], name, order, rec) for name, evs in files.items()
                     for order, rec in evs), key=lambda c: c[0])
    merged: list[tuple[Event, dict[str, int]]] = []
    for t, name, order, rec in copies:
        key = (rec["step"], rec["world"], rec.get("restart", 0))
        for event, places in reversed(merged):
            if (event.step, event.world, event.restart) == key and \
                    t - event.t <= EVENT_WINDOW_S and name not in places:
                places[name] = order
                if rec["event"] == "recovery":
                    event.kind = "recovery"
                break
        else:
            event = Event(rec["event"], rec["step"], rec["world"], t, key[2])
            merged.append((event, {name: order}))
    return merged


def _apply_restores(spans: list[Span], events: list[tuple[Event, dict[str, int]]]) -> None:
    """A restore to step S voids what steps after S consumed before it: in a file that
    holds the event, the spans written before its copy; in a file that does not (a rank
    gone before it), the spans begun before its first copy."""
    for span in spans:
        for event, places in events:
            place = places.get(span.file)
            before = span.order < place if place is not None else span.t < event.t
            if before:
                span.cut = min(span.cut, event.step)


def _order(seg: dict[str, Any]) -> np.ndarray | None:
    """The epoch's order of sample indices, recomputed (None when it cannot be)."""
    if seg["kind"] == "range":
        return np.arange(seg["n"])
    if seg["kind"] == "perm" and seg.get("seed") is not None:
        g = torch.Generator()
        g.manual_seed(seg["seed"])
        return torch.randperm(seg["n"], generator=g).numpy()
    return None


class _Epoch:
    """Positions of one epoch's order, how they map to samples, and who consumed them."""

    def __init__(self, seg: dict[str, Any], folder: Path) -> None:
        self.kind = seg["kind"]
        if self.kind == "bucket":
            lengths = np.load(folder / "lengths.npy")
            sampler = BucketBatchSampler(
                lengths, token_budget=seg["token_budget"], max_samples=seg["max_samples"],
                max_len=seg["max_len"], sort_size=seg["sort_size"],
                world_size=seg["world"], seed=seg["seed"], shuffle=seg["shuffle"],
                uneven=seg["uneven"])
            self.batches = sampler.epoch_batches(seg["epoch"])
            self.real = sampler.real_batches(seg["epoch"])
            self.weights = np.array([len(b) for b in self.batches], dtype=np.int64)
        else:
            self.order = _order(seg)
            self.real = seg["n"]  # None: a stream's (the audit takes what was read)
            self.weights = None  # one sample a position

    def count(self, counts: np.ndarray, start: int = 0) -> int:
        """Samples ``counts`` marks at positions ``start`` on (a bucket position is a
        batch of several)."""
        if self.weights is None:
            return int(counts[start:].sum())
        return int((counts[start:] * self.weights[start:len(counts)]).sum())

    def samples(self, positions: list[int]) -> list[int]:
        """The sample indices at these positions (positions themselves when the order
        cannot be recomputed)."""
        if self.kind == "bucket":
            return sorted(i for p in positions for i in self.batches[p])
        if self.order is None:
            return positions
        n = len(self.order)
        return [int(self.order[p if p < n else (p - n) % n]) for p in positions]


def epoch_positions(seg: dict[str, Any], k: Any) -> Any:
    """The epoch positions of positions ``k`` (an int or an array) of a rank's share in
    segment ``seg``: rank ``shard`` of ``world`` takes chunk ``shard`` of every row of
    ``world`` chunks after ``skip`` (a sampler's chunks are one item: ``skip + k * world
    + shard``; a stream's a batch).

    Example:
        >>> seg = {"skip": 0, "world": 2, "shard": 1, "chunk": 4}
        >>> [epoch_positions(seg, k) for k in (0, 3, 4)]
        [4, 7, 12]
    """
    chunk = seg.get("chunk", 1)
    row, within = divmod(k, chunk)
    return seg["skip"] + (row * seg["world"] + seg["shard"]) * chunk + within


def _share_position(seg: dict[str, Any], pos: int) -> int | None:
    """The position of ``pos`` in the share of ``seg``'s rank (None: another rank's)."""
    chunk = seg.get("chunk", 1)
    row, inside = divmod(pos - seg["skip"], seg["world"] * chunk)
    shard, within = divmod(inside, chunk)
    return row * chunk + within if shard == seg["shard"] and pos >= seg["skip"] else None


def _positions(span: Span) -> np.ndarray:
    """Epoch positions of what ``span`` consumed in its committed steps."""
    stop = span.end_at(span.cut)
    return epoch_positions(span.segment, np.arange(span.pos0, max(span.pos0, stop)))


def audit(run_dir: str | Path) -> AuditReport:
    """Audit the data ledger of ``run_dir``.

    Raises:
        FileNotFoundError: the run directory has no ledger.

    Example:
        >>> report = audit("runs/gpt-20261201-1200")  # doctest: +SKIP
        >>> report.ok, report.lines()[0]  # doctest: +SKIP
    """
    folder = Path(run_dir) / LEDGER_DIR
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"{folder} holds no ledger: the run was made before gpufleet kept one, or "
            f"{run_dir} is not a run directory (it holds config.toml and ledger/).")
    spans: list[Span] = []
    file_events: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for path in files:
        s, e = _read_file(path)
        spans += s
        file_events[path.name] = e
    events = _events(file_events)
    _apply_restores(spans, events)
    by_epoch: dict[int, list[Span]] = defaultdict(list)
    for span in spans:
        by_epoch[span.segment["epoch"]].append(span)
    committed = {ep: [s for s in ss if s.end_at(s.cut) > s.pos0] for ep, ss in by_epoch.items()}
    epochs_read = sorted(ep for ep, ss in committed.items() if ss)
    reports = []
    for ep in epochs_read:
        reports.append(_audit_epoch(ep, committed[ep], folder,
                                    later=any(e > ep for e in epochs_read)))
    notes = []
    if any(s.segment["kind"] == "source" for s in spans):
        notes.append("note: a sampler of your own gave the order; positions are named "
                     "instead of sample indices")
    if any(s.segment["kind"] == "stream" for s in spans):
        notes.append("note: the data is a stream (no length): its items are named by "
                     "their place in the pass, each epoch checked up to the furthest "
                     "item read; a short last row the ranks left out is not in the ledger")
    return AuditReport(reports, len(files), [e.describe() for e, _ in events], notes)


def replayed_since(run_dir: str | Path, step: int, before_t: float) -> tuple[int, int]:
    """What the ledgers of ``run_dir`` say the steps after ``step`` consumed before the
    wall-clock time ``before_t`` (a restore to ``step`` that began then): ``(samples,
    last step)``, the samples those steps took on every rank whose ledger is here (read
    again after the restore) and the highest step any rank took data for (-1: none).
    Restores before ``before_t`` apply, as in :func:`audit`; later lines are left out."""
    folder = Path(run_dir) / LEDGER_DIR
    spans: list[Span] = []
    file_events: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        s, e = _read_file(path)
        spans += [span for span in s if span.t < before_t]
        file_events[path.name] = [(order, rec) for order, rec in e if rec["t"] < before_t]
    _apply_restores(spans, _events(file_events))
    samples, last = 0, -1
    for span in spans:
        last = max(last, span.last_step)
        if min(span.last_step, span.cut) > step:
            samples += max(0, span.end_at(span.cut) - span.end_at(step))
    return samples, last


def _audit_epoch(epoch: int, spans: list[Span], folder: Path, later: bool) -> EpochReport:
    view = _Epoch(spans[0].segment, folder)
    positions = [_positions(s) for s in spans]
    read = max([int(p.max()) + 1 for p in positions if p.size] + [0])
    if view.real is None:  # a stream: the items up to the furthest read
        view.real = read
    top = max(read, view.real)
    counts = np.bincount(np.concatenate(positions), minlength=top)
    # The newest segments (the last resume's world size) say where the epoch ends.
    newest = [s for s in spans if s.segment["skip"] == max(x.segment["skip"] for x in spans)
              and s.segment["world"] == spans[-1].segment["world"]] or spans
    ends = _read_ends(newest)
    finished = later or ends is not None
    real = counts[:view.real]
    report = EpochReport(epoch, finished, view.count(np.ones(view.real, dtype=np.int64)))
    report.once = view.count((real == 1).astype(np.int64))
    report.padding = view.count(counts, view.real)
    dup = np.flatnonzero(counts > 1)
    if dup.size:
        report.problems.append(_duplicates(dup.tolist(), view, spans))
    if not finished:  # only what every shard has read past, or a later segment skipped
        bound = min(view.real, max(_reached(newest), max(x.segment["skip"] for x in spans)))
        missing = np.flatnonzero(real[:bound] == 0).tolist()
        if missing:
            report.problems.append(_missing(missing, view, spans))
    if finished:
        missing = set(np.flatnonzero(real == 0).tolist())
        dropped = missing & (ends or set()) if ends is not None else set()
        if later and ends is None:
            dropped = missing & _tails(newest, view.real)
        report.dropped = view.samples(sorted(dropped))
        missing -= dropped
        if missing:
            report.problems.append(_missing(sorted(missing), view, spans))
    return report


def _reached(newest: list[Span]) -> int:
    """The epoch position below which every shard of the newest segments has read."""
    seg = newest[0].segment
    reached = {}
    for s in newest:
        shard = s.segment["shard"]
        reached[shard] = max(reached.get(shard, 0), s.end_at(s.cut))
    if len(reached) < seg["world"]:
        return 0
    return seg["skip"] + min(reached.values()) * seg["world"]


def _read_ends(newest: list[Span]) -> set[int] | None:
    """The positions of the epoch the loader leaves out (drop_last) when every shard of
    the newest segments read its share to the end; None when one has not."""
    seg = newest[0].segment
    shards = {s.segment["shard"]: s for s in newest}
    if len(shards) < seg["world"] or seg["reads"] is None:  # (a stream: not known)
        return None
    out: set[int] = set()
    for shard, s in shards.items():
        reads = s.segment["reads"]
        if max(x.end_at(x.cut) for x in newest if x.segment["shard"] == shard) < reads:
            return None
        out |= _tail(s.segment, reads)
    return out


def _tails(newest: list[Span], real: int) -> set[int]:
    out: set[int] = set()
    for s in newest:
        if s.segment["reads"] is None:  # a stream's: its end is not recorded
            continue
        out |= _tail(s.segment, s.segment["reads"])
    return {p for p in out if p < real}


def _tail(seg: dict[str, Any], reads: int) -> set[int]:
    return {epoch_positions(seg, k) for k in range(reads, seg["items"])}


def _who(pos: int, spans: list[Span]) -> list[str]:
    """Who consumed epoch position ``pos``: rank, step and the event before."""
    out = []
    for s in spans:
        seg = s.segment
        k = _share_position(seg, pos)
        if k is not None and s.pos0 <= k < s.end_at(s.cut):
            out.append(f"rank {seg['shard']} of {seg['world']} at step {s.step_of(k)} "
                       f"(after {s.after})")
    return out


def _duplicates(dup: list[int], view: _Epoch, spans: list[Span]) -> str:
    first = dup[0]
    return (f"consumed more than once: sample(s) {_names(view.samples(dup))} (position(s) "
            f"{_names(dup)}); position {first} by " + "; ".join(_who(first, spans)))


def _missing(missing: list[int], view: _Epoch, spans: list[Span]) -> str:
    first = missing[0]
    before = _who(first - 1, spans) if first > 0 else []
    where = f"; the position before it was consumed by {before[0]}" if before else ""
    return (f"never consumed: sample(s) {_names(view.samples(missing))} (position(s) "
            f"{_names(missing)}){where}")
