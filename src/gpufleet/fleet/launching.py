"""Starting your loop's ranks: :class:`FleetLaunch`, the ``launch`` of
:class:`~gpufleet.fleet.Fleet` and the ``run()`` of a subclass, as Lightning Fabric's.

* ``fleet.launch(fn, *args)`` runs ``fn(fleet, *args)`` on every rank: here when this
  process is a rank already, else on ranks started now by torch's elastic agent. The
  run ends when ``fn`` returns.
* ``fleet.launch()`` without a function, in a process that is not a rank yet, runs the
  script again as each rank (Fabric's "re-run the script" launch). Under Fabric's
  process-starting strategies (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) there is
  no script to re-run in Fabric's sense: as Fabric, that is a ``TypeError`` asking for
  a function.
* A subclass that defines ``run()`` (Fabric's older form) is launched by calling it:
  ``MyFleet(...).run(*args)`` runs ``run(*args)`` on every rank and returns rank 0's
  result.
* Under Lightning's CLI (``fabric run``, which sets ``LT_CLI_USED=1`` in the processes it
  starts) the ranks exist already: as Fabric, ``launch`` is refused there, and so is a
  subclass with its own ``run()``.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.errors import NotLaunchedError
from gpufleet.fault.crash import crash_reported
from gpufleet.fleet.part import FleetPart
from gpufleet.fleet.steps import StepTracker
from gpufleet.plan import RunPlan
from gpufleet.train.engine.run import Run

#: Fabric's strategies that start their processes from ``launch(fn)`` (its
#: multiprocessing launcher): ``launch()`` without a function is refused under them.
SPAWNING_STRATEGIES = ("ddp_spawn", "ddp_fork", "ddp_notebook")
#: ``launch()``'s function left out (a ``None`` given is not a function: a TypeError).
NO_FUNCTION: Any = object()
#: What Lightning's CLI (``fabric run``) sets in the processes it starts.
CLI_VAR = "LT_CLI_USED"


def started_by_fabric_cli() -> bool:
    """This process was started by Lightning's CLI (``fabric run``): its ranks exist."""
    try:
        return bool(int(os.environ.get(CLI_VAR, "0")))
    except ValueError:
        return False


class FleetLaunch(FleetPart):
    """``launch`` and a subclass's ``run()`` of :class:`~gpufleet.fleet.Fleet` (a part of
    it)."""

    plan: RunPlan
    _init_args: dict[str, Any]
    _fleet_run: Run | None
    _steps: StepTracker
    _at_exit: Callable[[], None]
    finish: Callable[[], None]
    #: what each started rank runs (``gpufleet.fleet.fleet.rank_main``: a module-level
    #: function the ranks import, which builds the rank's own Fleet)
    _rank_entry: Callable[..., Any]

    def launch(self, fn: Any = NO_FUNCTION, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(fleet, *args, **kwargs)`` on every rank and return rank 0's result.

        When this process is a rank already (one device, torchrun, ``gpufleet run``),
        ``fn`` runs here. Otherwise the ranks are started now with torch's elastic agent
        (as ``gpufleet train --nproc N`` starts them): ``fn`` must then be a module-level
        function and ``args`` and ``kwargs`` picklable. The run ends (:meth:`finish`) when ``fn``
        returns; an error leaves a crash report in the run directory. Without ``fn``
        (Fabric's ``launch()``): on a rank, nothing to do; in a process that is not a
        rank yet, the script runs again as each rank (``python SCRIPT ARGS``, as
        ``gpufleet run`` starts it), and this process exits when they end.

        Raises:
            RuntimeError: the script was started by Lightning's CLI (``fabric run``),
                which started the ranks already (as Fabric).
            TypeError: ``fn`` is not callable (``None`` too: leave it out) or takes no
                argument (the Fleet is passed to it), or no ``fn`` under
                ``ddp_spawn``, ``ddp_fork`` or ``ddp_notebook`` (as Fabric).
        """
        self._check_launch(fn)
        if fn is NO_FUNCTION:
            if self._fleet_run is None:  # not a rank yet: the script runs again on each rank
                self._rerun_script()
            return None
        if self._fleet_run is not None:
            return self._run_here(fn, args, kwargs)
        return self._start_ranks(self._rank_entry, (self._init_args, fn, args, kwargs)).get(0)

    def _check_launch(self, fn: Any) -> None:
        """Fabric's refusals of ``launch``, in its words (a Fabric loop's tests match
        them), each naming the fix."""
        if started_by_fabric_cli():  # "Calling  `.launch()`": two spaces, Fabric's text
            raise RuntimeError(
                f"This script was launched through the CLI ({CLI_VAR}=1: `fabric run`), and "
                "processes have already been created. Calling  `.launch()` again is not "
                "allowed: call your function directly, fn(fleet), or start the script "
                "with `gpufleet run script.py --nproc N` and keep launch.")
        if fn is NO_FUNCTION:
            asked = self._init_args.get("strategy")
            if asked in SPAWNING_STRATEGIES:
                raise TypeError(
                    f"To spawn processes with the `{asked}` strategy, `.launch()` needs to "
                    "be called with a function that contains the code to launch in "
                    "processes: fleet.launch(train), where train(fleet) is your loop.")
            return
        if not callable(fn):
            raise TypeError(
                f"`Fleet.launch(...)` needs to be a callable, but got {fn!r}. "
                "HINT: do `.launch(your_fn)` instead of `.launch(your_fn())`.")
        try:
            takes_args = bool(inspect.signature(fn).parameters)
        except (TypeError, ValueError):  # no signature to read (a builtin): let it run
            takes_args = True
        if not takes_args:
            raise TypeError(
                f"`Fleet.launch(function={fn!r})` needs to take at least one argument: "
                "launch passes the Fleet to it. Define it as def fn(fleet): ...")

    def _own_run(self) -> None:
        """A subclass that defines ``run()``: calling it launches it (on every rank,
        rank 0's result returned), as Fabric wraps a subclass's ``run``."""
        if type(self).run is FleetLaunch.run:
            return
        if started_by_fabric_cli():  # Fabric's words, which its tests match
            raise TypeError(
                "Overriding `Fabric.run()` and launching from the CLI is not allowed "
                f"({CLI_VAR}=1: `fabric run`). Run the script normally (python script.py, "
                "or gpufleet run script.py --nproc N), or call your loop directly: "
                "fleet = Fleet(...); fleet.setup(...).")
        own = type(self).run
        launch = functools.partial(_launch_own_run, self, own)
        functools.update_wrapper(launch, own)
        # the instance's run: the subclass's, launched (an instance attribute: the
        # subclass's run is a plain function, which an instance's own value overrides)
        self.__dict__["run"] = launch

    @property
    def run(self) -> Run | None:
        """The run's parts on this rank (its config, device, directory and ``result``,
        the totals :meth:`finish` fills in); None before the ranks are started. A
        subclass may define its own ``run()`` instead, as with Fabric (see the module
        docs): read ``fleet.result`` there."""
        return self._fleet_run

    def _rerun_script(self) -> None:
        """Fabric's ``launch()`` outside a rank: this script runs again as each of the
        planned ranks (``python SCRIPT ARGS``, started by torch's elastic agent as
        ``gpufleet run`` starts them); this process waits for them and then exits
        with their status, instead of running the rest of the script itself."""
        script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
        main = sys.modules.get("__main__")
        if script is None or not script.is_file() or getattr(main, "__spec__", None):
            # (``python -m module``: start the ranks with gpufleet run or torchrun)
            self._rank_run()  # no script to run again: the error says how to start ranks
        self._start_ranks(sys.executable, (str(script), *sys.argv[1:]), "elastic")
        raise SystemExit(0)  # every rank ended well (a failure raised LaunchError)

    def _start_ranks(self, entry: Any, args: tuple, launcher: str | None = None
                     ) -> dict[int, Any]:
        """Start the planned ranks (with the plan's launcher, or ``launcher``), each
        running ``entry`` (a function, or a command for torch's elastic agent)."""
        plan, ranks = self.plan, self.plan.cfg.dist
        from gpufleet.launch.launcher import launch  # the agent: only where ranks start

        return launch(
            entry, args, nproc=plan.nproc,
            launcher=launcher or plan.launcher, nnodes=plan.nnodes, node_rank=plan.node_rank,
            master_addr=ranks.master_addr, master_port=ranks.master_port,
            rdzv_endpoint=ranks.rdzv_endpoint, rdzv_backend=ranks.rdzv_backend,
            rdzv_id=ranks.rdzv_id or plan.name, max_restarts=ranks.max_restarts,
            rdzv_timeout=ranks.rdzv_timeout)

    def _run_here(self, fn: Callable[..., Any], args: tuple, kwargs: dict | None = None
                  ) -> Any:
        with crash_reported(self._rank_run().view):
            try:
                out = fn(self, *args, **(kwargs or {}))
            except BaseException as error:  # what the run holds is let go of here
                atexit.unregister(self._at_exit)
                self._steps.abort(error)
                raise
            self.finish()
        return out

    def _rank_run(self) -> Run:
        if self._fleet_run is None:  # ("you must call `.launch()`": Fabric's words)
            raise NotLaunchedError(
                f"this Fleet plans {self.plan.nproc} ranks and this process is not one of "
                "them yet: you must call `.launch()` first. Put your loop in a function "
                "and call fleet.launch(fn), or start the script with `gpufleet run "
                "script.py --nproc N` or torchrun.")
        return self._fleet_run


def _launch_own_run(fleet: FleetLaunch, own: Callable[..., Any], *args: Any,
                    **kwargs: Any) -> Any:
    """``fleet.run(*args)`` of a subclass with its own ``run``: ``own(fleet, *args)`` on
    every rank (started now if this process is not one), rank 0's result."""
    if fleet._fleet_run is not None:
        return fleet._run_here(lambda f, *a, **k: own(f, *a, **k), args, kwargs)
    return fleet._start_ranks(fleet._rank_entry, (fleet._init_args, None, args, kwargs,
                                                   type(fleet))).get(0)

