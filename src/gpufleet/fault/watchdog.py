"""Hang forensics: notice a stalled step long before the process-group timeout.

Every rank runs a :class:`Watchdog` thread. The loop does nothing for it per step: the
thread reads the loop's phase marks (:mod:`gpufleet.core.phases`: a clock read per
phase change into a reused buffer) under the buffer's lock, and compares the time the
current step (or evaluation, or checkpoint) has run with ``fault.stall_factor`` × the
median of the recent ones, and never less than ``fault.stall_min_s``.

The ranks talk over the job's key-value store (the ``TCPStore`` the process group was
built on), which answers from its own thread even while every rank is blocked in a
collective. Each watchdog publishes a heartbeat (step, phase, since when) there. The
first rank to see a stall bumps a hang counter; every rank that sees the counter move
dumps its Python stacks to ``<run_dir>/hangs/<id>/rank-<R>.txt``, and rank 0 writes
``report.txt`` (:mod:`gpufleet.fault.stall_report`): which rank is behind and what the
others are waiting in, then each rank's position in collectives and in code
(:mod:`gpufleet.fault.forensics`: "rank 0 waits in all_reduce #41 (step 5, gradient
bucket 0); rank 1 last entered #38 and is at model.py:123 in forward"), naming
collectives the ranks disagree on. An all-reduce makes every rank's *step* slow, so
"behind" is read from how far each rank got (steps done, then the phase within the
step), not from step times.

A rank that stopped answering is told apart from one that is slow by
:mod:`gpufleet.fault.liveness`: after ``fault.heartbeat_timeout_s`` of silence, rank 0
writes a report naming the silent rank(s), their node and what their process is doing
(stopped, stuck in the kernel, dead, or alive without a running heartbeat thread, read
from ``/proc`` on its node; nothing from its node: the node is down or cut off), and the rank
that lost the store says it is the one cut off. Either then ends its process (exit code
:data:`EXIT_RANK_LOST`) instead of waiting out the collective timeout: the launcher
fails with that report, or the elastic agent restarts without the lost node.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.config import FaultConfig
from gpufleet.core.callbacks import Callback
from gpufleet.core.phases import Phase, PhaseMarks
from gpufleet.core.ring import RING
from gpufleet.core.threads import ServiceThread
from gpufleet.fault import flight_recorder, forensics, signal_stacks
from gpufleet.fault.fatal import FatalDump
from gpufleet.fault.liveness import Liveness, Verdict, side_channel
from gpufleet.fault.signal_stacks import SignalStacks
from gpufleet.fault.stall_report import stall_report, where_is

log = logging.getLogger(__name__)

# Which clock a phase runs on: training steps, evaluations and checkpoints are timed
# (and judged) apart.
_ACTIVITY = {Phase.EVAL: "eval", Phase.CHECKPOINT: "checkpoint"}
_KEY = "gpufleet/watchdog"
# Exit code of a rank that ended itself because a peer, or the store, stopped answering:
# sysexits.h EX_UNAVAILABLE. Not 75 (EX_TEMPFAIL), which says "preempted, checkpoint
# written" (gpufleet.fault.preempt): the launcher tells the two apart by it.
EXIT_RANK_LOST = 69


class Watchdog(Callback):
    """Watches this rank's progress; see the module docs.

    Args:
        cfg: the ``[fault]`` section.
        run_dir: where ``hangs/`` goes.
        rank / world_size: this rank's place in the job.
        store: the job's key-value store (``gpufleet.launch.job_store()``), or None in a
            single process.
        restart: the elastic restart count (keys and folders are per restart).
        node: this rank's node (its index, and its address when known), for reports.
    """

    def __init__(self, cfg: FaultConfig, run_dir: str | Path, rank: int = 0,
                 world_size: int = 1, store: Any = None, restart: int = 0,
                 node: tuple[int, str] = (0, "")) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        # Heartbeats and hang counters go over a connection of their own: a blocking
        # store call of the training thread must not hold them back.
        store = side_channel(store)
        self.rank, self.world_size, self.store = rank, world_size, store
        self.node = node
        self.prefix = f"{_KEY}/{restart}"
        self.folder_prefix = f"r{restart}-" if restart else ""
        self.phase, self.step = "setup", 0
        self.phase_since = time.time()  # wall clock: compared across hosts in reports
        # As of the phase marks read last (perf_counter seconds): the activity running
        # ("step", "eval", "checkpoint") and when it began, the phase and when it began.
        self._activity, self._activity_start = "step", time.perf_counter()
        self._phase, self._phase_at = self.phase, self._activity_start
        self._durations: dict[str, deque[float]] = {
            "step": deque(maxlen=100), "eval": deque(maxlen=20), "checkpoint": deque(maxlen=20)}
        self._marks: PhaseMarks | None = None  # the loop's, read under its lock
        self._view: Any = None
        self._flagged_start: float | None = None  # the activity reported already
        self._hangs_seen = 0
        self._local_hangs = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reports: list[Path] = []  # report.txt files written (rank 0)
        self.signal_stacks = SignalStacks(run_dir, rank)
        self.fatal = FatalDump(run_dir, rank)  # stacks and ring left by a fatal signal
        self.liveness = (Liveness(store, self.prefix, rank, world_size, self.heartbeat,
                                  cfg.watchdog_poll_s, cfg.heartbeat_timeout_s, self._lost)
                         if store is not None and world_size > 1 else None)
        self.exit = os._exit  # how a rank ends itself (tests replace it)
        # In-process recovery (gpufleet.train.recovery.recovery): told of ranks that stopped
        # answering instead of ending this rank; True when it took over.
        self.on_peers_lost: Callable[[Verdict], bool] | None = None

    # -- called by the loop (main thread) ------------------------------------------------
    phase_marks = True  # the loop's phase marks are read in batches and by the thread

    def on_fit_start(self, trainer: Any) -> None:
        self._view = trainer
        self.step = trainer.step
        RING.view = trainer  # each collective notes the step and phase under way
        self._activity, self._activity_start = "step", time.perf_counter()
        self._thread = ServiceThread(target=self._run, name="gpufleet-watchdog",
                                     stop=self._stop.set)
        self._thread.start()
        if self.liveness is not None:
            self.signal_stacks.start()  # a peer asks for them if this rank goes silent
            self.fatal.start()
            self.liveness.start()

    def rejoin(self, rank: int, world_size: int, store: Any, generation: int) -> None:
        """After the ranks left regrouped in process (:mod:`gpufleet.train.recovery.recovery`):
        the old heartbeats stop and new ones start under this rank's new place, in keys
        of this ``generation``, so the lost ranks are not reported as silent."""
        if self.liveness is not None:
            self.liveness.stop()
        store = side_channel(store)
        self.rank, self.world_size, self.store = rank, world_size, store
        self.liveness = (Liveness(store, f"{self.prefix}/g{generation}", rank, world_size,
                                  self.heartbeat, self.cfg.watchdog_poll_s,
                                  self.cfg.heartbeat_timeout_s, self._lost)
                         if store is not None and world_size > 1 else None)
        if self.liveness is not None:
            if self.signal_stacks._file is None:  # a rank that joined had no heartbeats
                self.signal_stacks.start()
            self.fatal.start()
            self.liveness.start()

    def on_phase_marks(self, trainer: Any, marks: PhaseMarks) -> None:
        """Time each step, evaluation and checkpoint the marks end (the loop holds
        ``marks.lock`` here); keep the buffer to read the newest marks from the thread."""
        self._marks = marks
        durations, end, kinds = self._durations, Phase.END, _ACTIVITY
        activity, start = self._activity, self._activity_start
        phase, phase_at = self._phase, self._phase_at
        for phase, phase_at in marks:
            if phase == end:  # a training step is done: the next one starts
                durations[activity].append(phase_at - start)
                activity, start = "step", phase_at
            elif activity != kinds.get(phase, "step"):  # into or out of eval / ckpt
                durations[activity].append(phase_at - start)
                activity, start = kinds.get(phase, "step"), phase_at
        self._activity, self._activity_start = activity, start
        self._phase, self._phase_at = phase, phase_at

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        self.stop(ended_well=True)

    def stop(self, ended_well: bool = False) -> None:
        """Stop the thread and the heartbeats; ``ended_well``: the run finished, so
        what a fatal signal would have left is removed (a failed run keeps it)."""
        if RING.view is self._view:
            RING.view = None  # the run is over: its view goes with it
        self._stop.set()
        self.signal_stacks.stop()
        if ended_well:
            self.fatal.stop()
        if self.liveness is not None:
            self.liveness.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _now(self) -> tuple[str, float, str, float]:
        """The activity running and when it began, the phase and when it began
        (perf_counter seconds): the state at the last read of the marks, moved on by
        the marks since (read under the buffer's lock). Also refreshes :attr:`step`,
        :attr:`phase` and :attr:`phase_since` (wall clock)."""
        marks = self._marks
        with marks.lock if marks is not None else contextlib.nullcontext():
            activity, start = self._activity, self._activity_start
            phase, phase_at = self._phase, self._phase_at
            for phase, phase_at in marks if marks is not None else ():
                if phase == Phase.END:
                    activity, start = "step", phase_at
                elif activity != _ACTIVITY.get(phase, "step"):
                    activity, start = _ACTIVITY.get(phase, "step"), phase_at
        if self._view is not None:
            self.step = self._view.step
        # Kept as given (a Phase is its name); heartbeats and reports write the name.
        self.phase = phase
        self.phase_since = time.time() - (time.perf_counter() - phase_at)
        return activity, start, phase, phase_at

    # -- the thread ---------------------------------------------------------------------
    def limit(self, activity: str) -> float:
        """Seconds after which the current ``activity`` counts as stalled."""
        past = self._durations[activity]
        typical = statistics.median(past) if past else 0.0
        return max(self.cfg.stall_min_s, self.cfg.stall_factor * typical)

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.watchdog_poll_s):
            try:
                self._tick()
            except Exception as e:  # the watchdog must never take training down
                log.debug("watchdog check failed: %s", e)

    def _tick(self) -> None:
        self._publish()
        activity, start, _, _ = self._now()
        elapsed = time.perf_counter() - start
        limit = self.limit(activity)
        if self._flagged_start != start and elapsed > limit:
            self._raise_hang()
            typical = self._durations[activity]
            log.warning("rank %d: this %s has run %.1f s (limit %.1f s; median %s): "
                        "dumping stacks", self.rank, activity, elapsed, limit,
                        f"{statistics.median(typical):.3g} s" if typical else "none yet")
        hangs = self._hang_count()
        if hangs > self._hangs_seen:
            self._hangs_seen = hangs
            self._flagged_start = start  # one report per stalled step, whoever saw it first
            folder = self.run_dir / "hangs" / f"{self.folder_prefix}{hangs}"
            self._dump_stacks(folder)
            if self.rank == 0:
                # Give every rank a couple of polls to publish and dump, then report.
                time.sleep(2 * self.cfg.watchdog_poll_s)
                self._publish()
                self._write_report(folder)

    # -- the store: heartbeats and the hang counter --------------------------------------
    def heartbeat(self) -> dict[str, Any]:
        activity, start, _, _ = self._now()
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "node": self.node[0], "addr": self.node[1],
                "step": self.step, "phase": str(self.phase), "phase_since": self.phase_since,
                "activity": activity, "activity_s": time.perf_counter() - start}

    def _publish(self) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}/hb/{self.rank}", json.dumps(self.heartbeat()))

    def _raise_hang(self) -> None:
        """Count a new hang, unless another rank already counted one that this rank has
        not handled yet (then this rank just dumps its stacks for that one)."""
        if self.store is None:
            self._local_hangs += 1
            return
        key = f"{self.prefix}/hangs"
        self.store.add(key, 0)  # make sure the counter exists
        # Atomic: seen -> seen + 1 only if no other rank moved the counter first.
        self.store.compare_set(key, str(self._hangs_seen), str(self._hangs_seen + 1))

    def _hang_count(self) -> int:
        if self.store is not None:
            return int(self.store.add(f"{self.prefix}/hangs", 0))  # an atomic read
        return self._local_hangs

    def heartbeats(self) -> list[dict[str, Any] | None]:
        """Every rank's newest heartbeat (None: none yet), read from the store."""
        if self.store is None:
            return [self.heartbeat()]
        if self.liveness is not None and self.rank == 0:
            # With their ages: a rank silent for a while is not "behind", it is gone.
            return self.liveness.verdict().beats
        beats: list[dict[str, Any] | None] = []
        for r in range(self.world_size):
            key = f"{self.prefix}/hb/{r}"
            beats.append(json.loads(self.store.get(key)) if self.store.check([key]) else None)
        return beats

    # -- what is written -----------------------------------------------------------------
    def _dump_stacks(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        beat = self.heartbeat()
        lines = [f"rank {self.rank} (host {beat['host']}, pid {beat['pid']}): step "
                 f"{self.step} done, in phase {str(self.phase)!r} for "
                 f"{time.time() - self.phase_since:.1f} s", ""]
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue  # this watchdog thread
            lines.append(f"--- thread {names.get(ident, ident)} ---")
            lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
            lines.append("")
        try:  # this rank's collectives, for the report's merge
            found = forensics.capture(self.rank)
            lines.extend(forensics.ring_lines(found["ring"]))
            forensics.write_capture(folder, found)
        except Exception as e:  # the stacks matter more: write them whatever happens
            log.warning("rank %d: could not record its collectives: %s", self.rank, e)
        (folder / f"rank-{self.rank}.txt").write_text("\n".join(lines))

    def _captures(self, folder: Path, ranks: list[int]) -> list[dict[str, Any]]:
        """Every answering rank's capture in ``folder``, waiting a few more polls for
        those not written yet (a rank's watchdog thread may run late on a loaded host)."""
        deadline = time.monotonic() + 10 * self.cfg.watchdog_poll_s + 2.0
        while True:
            captures = forensics.read_captures(folder)
            if {c["rank"] for c in captures} >= set(ranks) or time.monotonic() > deadline:
                return captures
            time.sleep(self.cfg.watchdog_poll_s)

    def _lost(self, verdict: Verdict) -> None:
        """A peer or the store stopped answering: report it, then end this rank."""
        folder = self.run_dir / "hangs" / f"{self.folder_prefix}lost-rank{self.rank}"
        timeout = self.cfg.heartbeat_timeout_s
        if verdict.silent:
            text = stall_report(verdict.beats, time.time(), silent_after=timeout)
        else:
            text = (f"rank {self.rank} ({where_is(self.heartbeat())}) lost contact with the "
                    f"job: the store on rank 0's node has not answered for "
                    f"{verdict.cut_off_s:.0f} s. This node is cut off from the others (a "
                    "network partition) or rank 0's node is down.")
        recover = bool(verdict.silent) and self.on_peers_lost is not None
        text += (f"\nRank {self.rank} aborts the collective and goes on in process without "
                 "them, from the newest in-memory snapshot." if recover else
                 f"\nEnding rank {self.rank} (exit code {EXIT_RANK_LOST}) rather than "
                 f"waiting out the collective timeout; with --max-restarts and an elastic "
                 "--nnodes MIN:MAX the agent restarts without the lost node.")
        text += signal_stacks.ask_silent(self.run_dir, verdict.silent) + _end_stopped(verdict)
        try:
            self._dump_stacks(folder)
            (folder / "report.txt").write_text(text + "\n")
            self.reports.append(folder / "report.txt")
        except OSError as e:
            log.warning("could not write the report to %s: %s", folder, e)
        log.error("%s (report in %s)", text, folder)
        for handler in logging.getLogger().handlers:
            handler.flush()
        if recover and self.on_peers_lost is not None and self.on_peers_lost(verdict):
            return  # the training thread's collective fails now, and it recovers
        self.exit(EXIT_RANK_LOST)  # the training thread sits in a collective: end here

    def _write_report(self, folder: Path) -> None:
        beats = self.heartbeats()
        text = stall_report(beats, time.time(), silent_after=self.cfg.heartbeat_timeout_s / 2)
        answering = [b["rank"] for b in beats
                     if b and b.get("age_s", 0.0) <= self.cfg.heartbeat_timeout_s / 2]
        captures = self._captures(folder, answering)
        merged = forensics.merge(captures)
        if merged is not None:
            if merged.mismatch:  # the cause, not a slow rank: said first
                text = merged.mismatch + "\n\n" + text
            said = [x for x in (merged.where, merged.stuck) if x]
            if said:
                text += "\n\nCollectives and code:\n" + "\n".join(said)
        note = flight_recorder.report_note(
            next((c["backend"] for c in captures if c.get("backend")), ""),
            list(range(self.world_size)))
        if note:
            text += "\n" + note
        path = folder / "report.txt"
        path.write_text(text + f"\nStacks: {folder}/rank-*.txt\n")
        self.reports.append(path)
        log.error("stalled step: %s (stacks and report in %s)", text.splitlines()[0],
                  folder)


def _end_stopped(verdict: Verdict) -> str:
    """SIGKILL the silent ranks found stopped (state T) on this node: a stopped process
    cannot take the launcher's SIGTERM, which would hold the end of the run back by the
    launcher's grace period. Returns what was done, for the report."""
    ended = []
    for beat in verdict.silent.values():
        if not beat or beat.get("proc_state") not in ("T", "t") or \
                beat.get("host") != socket.gethostname():
            continue
        try:
            os.kill(int(beat["pid"]), signal.SIGKILL)
            ended.append(f"rank {beat['rank']} (pid {beat['pid']})")
        except (OSError, KeyError, ValueError) as e:
            log.debug("could not end stopped rank %s: %s", beat.get("rank"), e)
    if not ended:
        return ""
    return (f"\nEnded the stopped {', '.join(ended)} with SIGKILL (a stopped process "
            "cannot take the launcher's SIGTERM).")
