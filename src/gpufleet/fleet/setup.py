"""Handing your model, optimizers and loaders to the run: :class:`FleetSetup`, the
``setup`` methods of :class:`~gpufleet.fleet.Fleet`, named and shaped as Lightning
Fabric's.

A model is placed as the run's strategy says (:func:`gpufleet.parallel.parallelize.
parallelize`); an optimizer handed with it is rebuilt on the placed parameters by name
(:mod:`gpufleet.train.recipe`), one built afterwards on them is taken as it is; every
optimizer step goes through the run (:class:`~gpufleet.fleet.steps.StepTracker`). A
loader is sharded over the ranks with a resumable sampler.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from gpufleet.core.tree import to_device
from gpufleet.errors import ConfigError
from gpufleet.fleet.loader import FleetLoader, shard_loader
from gpufleet.fleet.run import FleetPart
from gpufleet.fleet.seeding import add_worker_seeding
from gpufleet.fleet.steps import StepTracker
from gpufleet.fleet.wrappers import FleetModule, hook_step, hook_zero_grad
from gpufleet.train.guard.nonfinite import NonFiniteGuard
from gpufleet.train.recipe import place_scheduler, spec_from_optimizer

log = logging.getLogger(__name__)


class FleetSetup(FleetPart):
    """The ``setup`` methods of :class:`~gpufleet.fleet.Fleet` (a part of it)."""

    _placed: list[nn.Module]  # every model set up, as placed
    _seed_workers: bool  # seed_everything(workers=True) was called
    _steps: StepTracker

    def setup(self, module: nn.Module, *optimizers: torch.optim.Optimizer,
              scheduler: Any = None, move_to_device: bool = True) -> Any:
        """Place ``module`` as the run's strategy says and rebuild ``optimizers`` on the
        placed parameters (by parameter name: groups and settings kept, state not).
        COLLECTIVE (ddp broadcasts rank 0's weights).

        ``scheduler`` (Fabric's): an LR scheduler built on one of ``optimizers``; it is
        moved onto that optimizer's rebuilt one (with the schedulers it chains) and
        returned last, so that its learning rates reach training.

        ``move_to_device=False`` (Fabric's: leave the model where it is) is taken where
        nothing would move: the module's parameters and buffers are all on this rank's
        device already. Elsewhere it is refused: the strategy trains the model on this
        rank's device (DDP, FSDP and the precision work there).

        Returns:
            The model (a :class:`FleetModule`), ``(model, *optimizers)``, or with a
            ``scheduler``, ``(model, *optimizers, scheduler)``. Build any other LR
            scheduler on an optimizer returned here.
        """
        run = self._rank_run()
        if not move_to_device:
            _check_in_place(module, run.device)
        scheduled = _scheduled_index(scheduler, optimizers)
        specs = [spec_from_optimizer(opt, module) for opt in optimizers]
        for i, opt in enumerate(optimizers):
            if i != scheduled:
                _warn_if_scheduled(opt)
        from gpufleet.parallel.parallelize import parallelize  # heavy: layer options

        placed = parallelize(module, run.strategy, run.cfg, run.env.world_size)
        self._placed.append(placed)
        if run.model is None:  # the run's model until an optimizer names its own
            run.model = placed
        wrapped = FleetModule(placed, run.strategy.unwrap(placed),
                              self._steps.phase_announce, run.precision)
        built = [run.strategy.setup_optimizer(placed, spec) for spec in specs]
        self._take_optimizers(placed, built)
        if scheduled is not None:
            return (wrapped, *built, place_scheduler(scheduler, built[scheduled]))
        return wrapped if not built else (wrapped, *built)

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> FleetModule:
        """:meth:`setup` without an optimizer: build it afterwards on the returned
        model's parameters (sharded ones, under fsdp) and pass it to
        :meth:`setup_optimizers`."""
        return self.setup(module, move_to_device=move_to_device)

    def setup_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """Optimizers built on the parameters of a model :meth:`setup_module` returned,
        made ready as :meth:`setup` makes them (rebuilt by the strategy: zero1 shards
        it, local_sgd averages, ...; groups and settings kept, state not). Use the ones
        returned: the optimizer, or a tuple of them."""
        run = self._rank_run()
        built = []
        for opt in optimizers:
            params = {id(p) for group in opt.param_groups for p in group["params"]}
            owner = next((m for m in self._placed
                          if params <= {id(p) for p in m.parameters()}), None)
            if owner is None:
                raise ConfigError(
                    f"setup_optimizers: this {type(opt).__name__} holds parameters of no "
                    "model set up by this Fleet. Build it on the parameters of the model "
                    "setup_module returned, or pass model and optimizer to "
                    "fleet.setup(model, optimizer).")
            spec = spec_from_optimizer(opt, run.strategy.unwrap(owner))
            _warn_if_scheduled(opt)
            built.append(run.strategy.setup_optimizer(owner, spec))
            self._take_optimizers(owner, built[-1:])
        return built[0] if len(built) == 1 else tuple(built)

    def _take_optimizers(self, placed: nn.Module, optimizers: list) -> None:
        """The first optimizer of the run is the primary one (its steps are the run's
        steps, the non-finite guard watches its model); every step goes through the
        run."""
        run, steps = self._rank_run(), self._steps
        for opt in optimizers:
            primary = run.optimizer is None
            if primary:
                run.model, run.optimizer = placed, opt
                run.scheduler.optimizer = opt
                if run.cfg.fault.skip_nonfinite:
                    run.nonfinite = NonFiniteGuard(run.cfg.fault, run.strategy,
                                                   run.precision)
                hook_zero_grad(opt, steps.on_zero_grad)
            hook_step(opt, steps.primary_step if primary else steps.other_step)

    def setup_dataloaders(self, *loaders: Any, use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        """Each loader sharded over the ranks with a resumable sampler (its position is
        saved by :meth:`save`), its batches moved to this rank's device.

        A loader that shuffled is shuffled per epoch as torch's
        ``DistributedSampler(seed=run.seed)`` would on several ranks, and as its own
        ``RandomSampler`` would in a job of one process; a sampler of your own
        (weighted, a subset) keeps its draws, sharded over the ranks as Fabric shards
        them.

        Returns:
            One :class:`~gpufleet.fleet.loader.FleetLoader`, or a tuple of them.
        """
        run = self._rank_run()
        shard, shards = run.strategy.data_shard(run.env.rank, run.env.world_size)
        out = []
        for loader in loaders:
            sampler = None
            if use_distributed_sampler:
                loader, sampler = shard_loader(loader, rank=shard, world_size=shards,
                                               seed=run.cfg.run.seed)
            if self._seed_workers:  # seed_everything(workers=True), Fabric's default
                add_worker_seeding(loader, run.env.rank)
            mover = None
            if move_to_device and run.device.type != "cpu":
                device = run.device
                mover = lambda batch, d=device: to_device(batch, d, non_blocking=True)  # noqa: E731
            fleet_loader = FleetLoader(loader, sampler, self._steps.on_batch, mover)
            run.data.loaders.append(fleet_loader)
            run.data.pin_memory = run.data.pin_memory or bool(loader.pin_memory)
            out.append(fleet_loader)
        return out[0] if len(out) == 1 else tuple(out)


def _scheduled_index(scheduler: Any, optimizers: tuple) -> int | None:
    """Which of ``optimizers`` ``scheduler`` was built on (None: no scheduler)."""
    if scheduler is None:
        return None
    target = getattr(scheduler, "optimizer", None)
    found = next((i for i, opt in enumerate(optimizers) if opt is target), None)
    if found is None:
        raise ConfigError(
            f"setup(scheduler=...): this {type(scheduler).__name__} was not built on an "
            "optimizer given to this setup call. Pass the optimizer it steps, "
            "fleet.setup(model, optimizer, scheduler=scheduler), or build the scheduler "
            "after setup on the optimizer setup returns.")
    return found


def _check_in_place(model: nn.Module, device: torch.device) -> None:
    """``setup(move_to_device=False)``: take it where the model is on ``device`` already
    (nothing moves), refuse it elsewhere, naming where the model is."""
    elsewhere = sorted({str(t.device) for t in [*model.parameters(), *model.buffers()]
                        if t.device != device})
    if elsewhere:
        raise ConfigError(
            f"setup(move_to_device=False): the model has tensors on {', '.join(elsewhere)} "
            f"and this rank trains on {device}. gpufleet places the model as its strategy "
            "says (DDP, FSDP and the precision work on this rank's device), so it cannot "
            f"leave it there. Move it yourself (model.to(fleet.device)) or build it on "
            f"{device}, or drop move_to_device=False.")


def _warn_if_scheduled(optimizer: torch.optim.Optimizer) -> None:
    """Say so when an LR scheduler was built on ``optimizer`` before it was set up
    (torch's schedulers put ``initial_lr`` in its groups and wrap its ``step``): the run
    trains with the optimizer ``setup`` returns, so that scheduler's learning rates
    would never reach training (with Fabric, which wraps the same object, they do)."""
    if any("initial_lr" in group for group in optimizer.param_groups) or \
            getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        log.warning(
            "an LR scheduler was built on this %s before fleet.setup: Fleet trains with "
            "the optimizer setup returns (rebuilt on the placed parameters), so that "
            "scheduler's learning rates would not reach training. Hand it to setup "
            "(model, optimizer, scheduler = fleet.setup(model, optimizer, "
            "scheduler=scheduler)), or build it after setup on the optimizer setup "
            "returns.", type(optimizer).__name__)
