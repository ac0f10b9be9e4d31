"""Preemption in your own loop: :class:`FleetPreemption`, the part of
:class:`~gpufleet.fleet.Fleet` that turns SIGTERM or SLURM's SIGUSR1 into a checkpoint
and exit status 75, as ``gpufleet train`` does (:mod:`gpufleet.fault.preempt`).

The contract:

* **What is saved**: the state your loop registered with :meth:`register_state` (the
  dict you would hand :meth:`~gpufleet.fleet.Fleet.save`: models, optimizers,
  schedulers, set-up loaders, your plain values), read when the checkpoint is written;
  without one, the last dict your loop handed ``fleet.save``; without either, nothing
  (the run still stops, and says so).
* **When**: every rank agrees at the end of every ``fault.preempt_check_every``-th
  optimizer step (one int all-reduced on the CPU), so all of them stop after the same
  step even when one rank alone got the signal. The checkpoint is written when your
  loop begins its next step (it asks a set-up loader for a batch, calls a set-up model,
  or calls ``fleet.backward``): by then your loop has done what follows a step (its
  counters, its scheduler, its own saves), so the state is that of a step boundary.
* **Where**: the run directory's ``checkpoints/step-NNNNNNN.pt`` (a directory of
  shards under ``fsdp``, ``hsdp`` and tensor parallel), written by ``fleet.save``
  (atomic, checksummed), the newest ``checkpoint.keep_last`` kept.
* **Then**: the run ends as at ``fleet.finish()`` (the last log line, diagnosis,
  report) and the rank raises ``SystemExit(75)`` (``EX_TEMPFAIL``: run me again), which
  your ``except Exception`` does not catch; ``gpufleet run`` exits 75 too.
* **Resuming**: start the same script again with ``Fleet(resume="auto")`` (or
  ``"latest"``) and the same ``run_dir`` (or, without one, the same ``name``):
  :attr:`resume_from` is the newest intact checkpoint, and ``fleet.load(
  fleet.resume_from, state)`` restores it, loaders' positions, RNG states and
  ``fleet.step`` included, so the loop goes on as if never stopped.

Ctrl-C (SIGINT) is left to your loop: it raises ``KeyboardInterrupt`` as usual. A stop
signal that arrives after the loop's last step check (or in a loop that never steps) is
not lost: when the run ends, the process takes it as it would have without gpufleet.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.errors import ConfigError
from gpufleet.fault.preempt import exit_status, signal_name
from gpufleet.fleet.part import FleetPart
from gpufleet.train.checkpoint.files import checkpoint_path, prune
from gpufleet.train.engine.run import Run

log = logging.getLogger(__name__)


class FleetPreemption(FleetPart):
    """``register_state``, ``resume_from`` and ``should_stop`` of
    :class:`~gpufleet.fleet.Fleet` (a part of it), and its stop on a signal."""

    _fleet_run: Run | None  # this rank's (Fleet's)
    _registered: dict[str, Any] | None = None  # what a preemption checkpoint saves
    _last_saved: dict[str, Any] | None = None  # the last dict fleet.save was handed

    if TYPE_CHECKING:  # the other parts' (FleetCheckpoints.save, Fleet._end)
        def save(self, path: str | Path, state: dict[str, Any],
                 filter: Any = None) -> Path: ...

        def _end(self, collective: bool) -> None: ...

        def _keep_in_memory(self, state: dict[str, Any]) -> None: ...

    def register_state(self, state: dict[str, Any]) -> None:
        """Save ``state`` (a dict as :meth:`~gpufleet.fleet.Fleet.save` takes it) when
        the run is preempted (SIGTERM, SLURM's SIGUSR1): kept by reference and read
        when the checkpoint is written, so register the dict your loop keeps up to date
        once, before the loop. See :mod:`gpufleet.fleet.preemption`.

        Raises:
            TypeError: ``state`` is not a dict.
        """
        if not isinstance(state, dict):
            raise TypeError(f"register_state takes the dict you would hand fleet.save "
                            f"(models, optimizers, loaders, values), not a "
                            f"{type(state).__name__}.")
        self._registered = state
        self._keep_in_memory(state)  # what the snapshots take (fault.snapshot_every)

    @property
    def resume_from(self) -> Path | None:
        """The checkpoint this run resumes from: with ``Fleet(resume="auto")`` the
        newest intact one of the run directory (or of the newest run of this name),
        None for a fresh start; with ``resume="latest"`` it must exist. Hand it to
        ``fleet.load(fleet.resume_from, state)``."""
        return self._rank_run().resume_from

    @property
    def should_stop(self) -> bool:
        """Every rank agreed to stop at a step's end because one was asked to (a
        callback's ``view.request_stop``, early stopping); the reason is in
        ``fleet.run.result.stopped_early``. Your loop decides what to do (``break``).
        The same on every rank."""
        return bool(self._rank_run().result.stopped_early)

    def _pass_on_signal(self) -> None:
        """A stop signal this rank got that no step boundary came to act on (the loop
        ended, or never stepped, before the next check): now that the run has ended and
        its handlers are put back, the process takes it as it would have without the
        run (the default for SIGTERM and SIGUSR1: the process ends)."""
        run = self._fleet_run
        watch = run.monitors.preemption if run is not None else None
        if watch is None or watch.received is None or run is None or run.result.preempted:
            return
        if run.env.is_main:
            log.warning("%s arrived after the loop's last step check: no checkpoint was "
                        "written, and the process now takes the signal as it would "
                        "without gpufleet", signal_name(watch.received))
        signal.raise_signal(watch.received)

    def _stop_for_preemption(self) -> None:
        """The ranks agreed to stop for a signal and the loop begins its next step:
        save the registered state in the run directory (COLLECTIVE), end the run as
        ``finish`` does, and leave with the requeue status."""
        run = self._rank_run()
        watch = run.monitors.preemption
        assert watch is not None and watch.received is not None, "a signal was agreed"
        run.result.preempted = signal_name(watch.received)
        state = self._registered if self._registered is not None else self._last_saved
        saved = "no checkpoint (register one with fleet.register_state(state))"
        if state is not None:
            path = checkpoint_path(run.run_dir, run.state.step)
            if run.strategy.saves_on_every_rank:  # a directory of every rank's shards
                path = path.with_suffix("")
            if path.exists():
                raise ConfigError(f"{path} exists already: this run wrote a checkpoint "
                                  "of this step before. Leave the run directory's "
                                  "checkpoints/ to gpufleet.")
            self.save(path, state)  # COLLECTIVE
            run.result.checkpoint = str(path)
            saved = f"a checkpoint at {path}"
        if run.env.is_main:
            log.warning("%s received: stopped after step %d with %s. Start the script "
                        "again with Fleet(resume=\"auto\") and fleet.load("
                        "fleet.resume_from, state) to go on.", run.result.preempted,
                        run.state.step, saved)
        self._end(collective=True)  # COLLECTIVE: the last log line, diagnosis, report
        if state is not None and run.env.is_main:
            prune(run.run_dir, run.cfg.checkpoint.keep_last)
        raise SystemExit(exit_status(watch.received))
