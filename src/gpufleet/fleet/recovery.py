"""A lost node recovered inside your own loop: in-memory snapshots of the state your loop
registered, and :class:`Recovered`, which the Fleet call that met the loss raises once
the ranks left went on in process.

The contract (see ``docs/own-loop.md``, "Losing a node"):

* **What a snapshot holds**: the dict your loop registered with
  :meth:`~gpufleet.fleet.Fleet.register_state` (models, optimizers, schedulers, set-up
  loaders' positions, your plain values), ``fleet.step`` and this rank's RNG states,
  as :meth:`~gpufleet.fleet.Fleet.save` would write them, from this rank alone (no
  collective), into host memory (:mod:`gpufleet.fault.snapshot`).
* **When**: every ``fault.snapshot_every`` optimizer steps of the first optimizer set
  up, taken when your loop begins its next step (asks a set-up loader for a batch,
  calls a set-up model or ``fleet.backward``): by then its scheduler, its counters and
  its ``zero_grad`` are done, so the state is a step boundary's (the point a preemption
  saves at).
* **When a node is lost**: the Fleet call under way whose collective fails (a set-up
  model's forward, ``backward``, an optimizer's step through what ``setup`` returned,
  ``all_reduce`` and the other collectives, ``save``) has the ranks left regroup in
  their processes through the same recovery as ``gpufleet train``
  (:mod:`gpufleet.train.recovery.recovery`), restores the newest snapshot into the
  registered objects in place (your plain values replaced in the dict; the loaders'
  positions split over the new world, so every sample of the epoch is read once) and
  raises :class:`Recovered`. Your loop catches it and begins its step again from the
  registered state; a loop that does not ends, and the elastic agent restarts it.

:class:`FleetLoopState` is the registered state as the engine's recovery reads it (a
:class:`~gpufleet.train.recovery.loopstate.LoopState`); :class:`FleetRecovery` is the
part of :class:`~gpufleet.fleet.Fleet` that catches the loss.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Literal

from torch import nn
from torch.optim import Optimizer

from gpufleet.fault.snapshot import optimizer_storages
from gpufleet.fleet.loader import FleetLoader, SetUpLoaders
from gpufleet.fleet.part import FleetPart
from gpufleet.fleet.state import FLEET_KEY, check_keys, plain_entries, put_back, saveable
from gpufleet.fleet.steps import StepTracker
from gpufleet.fleet.wrappers import FleetModule, unwrap_optimizer
from gpufleet.train.engine.run import Run
from gpufleet.train.recovery.recovery import rewrap
from gpufleet.train.seed import rng_state, set_rng_state

log = logging.getLogger(__name__)


class Recovered(BaseException):  # a signal to the loop (as SystemExit), not an error
    """The ranks left after a lost node went on in process, and the state your loop
    registered is back at the step of the newest snapshot: begin the step again.

    Like ``SystemExit``, it is not an ``Exception``: an ``except Exception`` in your
    loop lets it through to the ``except gpufleet.Recovered`` that continues the loop.

    Attributes:
        step: the step the state is back at (``fleet.step``).
        world_size: the ranks that go on.
    """

    def __init__(self, step: int, world_size: int) -> None:
        super().__init__(f"recovered in process: the registered state is back at step "
                         f"{step}, on {world_size} rank(s); begin the step again (catch "
                         "gpufleet.Recovered in your loop and continue)")
        self.step, self.world_size = step, world_size


class FleetLoopState:
    """The state your loop registered, as snapshots capture it and the engine's recovery
    restores it (a :class:`~gpufleet.train.recovery.loopstate.LoopState`).

    Args:
        run: this rank's run.
        state: the registered dict (read when a snapshot is taken, put back in place).
        loaders: every loader set up (resharded over the new world).
        modules: every model set up, as your loop holds it (each runs the model placed
            again over the new process group).
        placed: the set-up models as placed (kept up to date for ``fleet.save``).
        wait_for_saves: waits for a background ``fleet.save`` under way (this rank).
    """

    def __init__(self, run: Run, state: dict[str, Any], loaders: SetUpLoaders,
                 modules: Sequence[FleetModule], placed: list[nn.Module],
                 wait_for_saves: Callable[[], Any]) -> None:
        check_keys(state, None)
        self.run, self.state, self.loaders = run, state, loaders
        self.modules, self.placed, self._wait_for_saves = modules, placed, wait_for_saves

    @property
    def boundary_at_step_end(self) -> bool:
        return False  # your scheduler and counters follow the optimizer's step

    @property
    def sampler(self) -> Any:
        """The first registered loader's sampler (its position is global), or None
        where no set-up loader is registered (your data position is your own)."""
        loader = next((v for v in self.state.values() if isinstance(v, FleetLoader)), None)
        return None if loader is None else loader.sampler

    def unrestorable(self) -> str:
        """Why a snapshot of this state could not be put back ("" when it can)."""
        blind = [k for k, v in self.state.items()
                 if isinstance(v, FleetLoader) and v.sampler is None]
        if blind:
            return (f"the registered loader {blind[0]!r} was set up with "
                    "use_distributed_sampler=False, so gpufleet knows no position of it "
                    "to put back; let setup_dataloaders shard it")
        return ""

    def capture(self) -> dict[str, Any]:
        """The registered state as ``fleet.save`` would write it, from this rank alone
        (the live tensors; a snapshot copies them): ``fleet.step`` and this rank's RNG
        states beside it. Your plain values are deep-copied (a later change of a list
        or an object of yours must not change the snapshot)."""
        run = self.run
        content = saveable(self.state, run.strategy, rank=run.env.rank)
        content.update(copy.deepcopy(plain_entries(self.state, content)))
        content[FLEET_KEY] = {"rng": rng_state(), "step": run.state.step}
        return content

    def storages(self) -> set[int]:
        values = list(self.state.values())
        return optimizer_storages(
            [v for v in values if isinstance(v, nn.Module)],
            [unwrap_optimizer(v) for v in values
             if isinstance(unwrap_optimizer(v), Optimizer)])

    def wait(self) -> None:
        self._wait_for_saves()

    def regroup(self, rank: int, shard: int, shards: int, copies: int) -> None:
        """Every set-up loader reads shard ``shard`` of ``shards`` from its next pass,
        and every set-up model runs as placed again over the new group (the first
        optimizer's model the recovery placed; any other, a GAN's second, here:
        COLLECTIVE, in the order they were set up)."""
        run = self.run
        for loader in self.loaders.loaders:
            if loader.sampler is not None:
                loader.sampler.rank, loader.sampler.world_size = shard, shards
        self.loaders.data_copies = copies
        primary = run.parts[0].model  # placed again by the recovery already
        for i, old in enumerate(self.placed):
            same = getattr(old, "module", old) is getattr(primary, "module", primary)
            new = primary if same else rewrap(old, run.strategy, run.device)
            self.placed[i] = new
            for module in self.modules:
                if module.placed is old:
                    module.place(new)

    def restore(self, state: dict[str, Any], source: str) -> int:
        """Put ``state`` back into the registered objects in place (your plain values
        replaced in the dict), this rank's RNG states too; returns its step."""
        own = state.pop(FLEET_KEY)
        put_back(self.state, state, self.run.strategy, self.placed)
        set_rng_state(own["rng"])
        if self.run.env.is_main:
            log.info("the registered state is back at step %d, from %s", own["step"],
                     source)
        return int(own["step"])


class RecoveryGuard:
    """The context every Fleet call that runs a collective runs in: an error there that
    the run's recovery takes as a lost peer has the ranks left regroup in process
    (:meth:`gpufleet.train.recovery.recovery.Recovery.recover`), and :class:`Recovered`
    takes its place; any other error goes on as it was. One object, entered again and
    again (no allocation per call).

    Args:
        run: this rank's run (its recovery, when it has one).
        went_on: called after a recovery, before :class:`Recovered` is raised (the
            step's own bookkeeping starts again).
    """

    def __init__(self, run: Run, went_on: Callable[[], None]) -> None:
        self.run, self.went_on = run, went_on

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> Literal[False]:
        run = self.run
        if error is None or not isinstance(error, Exception) or run.recovery is None:
            return False  # (Recovered, SystemExit and KeyboardInterrupt pass through)
        if not run.recovery.recover(error):  # not a lost peer, or recovery failed
            return False
        self.went_on()
        raise Recovered(run.state.step, run.env.world_size) from None


class FleetRecovery(FleetPart):
    """What :class:`~gpufleet.fleet.Fleet` keeps to survive a lost node (a part of it):
    the registered state as the snapshots take it, the guard of its calls."""

    _fleet_run: Run | None  # this rank's (Fleet's)
    _placed: list[nn.Module]  # every model set up, as placed
    _modules: list[FleetModule]  # every model set up, as your loop holds it
    _steps: StepTracker

    def _wait_for_saves(self, collective: bool) -> str | None:  # FleetCheckpoints'
        raise NotImplementedError

    def _keep_in_memory(self, state: dict[str, Any]) -> None:
        """The registered ``state`` is what the snapshots take (``fault.snapshot_every``
        on), where it can be put back; said where it cannot."""
        run = self._fleet_run
        if run is None or not run.cfg.fault.snapshot_every:
            return
        loop = FleetLoopState(run, state, self._loaders, self._modules, self._placed,
                              lambda: self._wait_for_saves(collective=False))
        reason = loop.unrestorable()
        if reason:
            if run.env.is_main:
                log.warning("fault.snapshot_every = %d: no snapshots are taken: %s",
                            run.cfg.fault.snapshot_every, reason)
            return
        if self._steps.interval is not None and run.env.is_main:  # the loop began
            log.warning("fleet.register_state was called after the loop's first step: "
                        "no snapshots are taken; register the state before the loop")
        run.loop_state = loop
