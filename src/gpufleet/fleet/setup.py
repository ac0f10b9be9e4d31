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

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from gpufleet.core.tree import to_device
from gpufleet.errors import ConfigError, unknown_choice
from gpufleet.fleet.accumulate import Accumulation
from gpufleet.fleet.dtypes import ForwardDtypes
from gpufleet.fleet.loader import FleetLoader, shard_loader
from gpufleet.fleet.order import ORDERS, AccelerateOrder, accelerate_generator_state
from gpufleet.fleet.part import FleetPart
from gpufleet.fleet.seeding import add_worker_seeding, chosen_seed, seeds_workers
from gpufleet.fleet.steps import StepTracker
from gpufleet.fleet.stream import FleetStreamLoader, shard_stream
from gpufleet.fleet.wrappers import FleetModule, FleetOptimizer, watch_direct_steps
from gpufleet.train.engine.run import ModelPart
from gpufleet.train.guard.nonfinite import NonFiniteGuard
from gpufleet.train.recipe import place_scheduler, spec_from_optimizer

log = logging.getLogger(__name__)


class FleetSetup(FleetPart):
    """The ``setup`` methods of :class:`~gpufleet.fleet.Fleet` (a part of it)."""

    _placed: list[nn.Module]  # every model set up, as placed
    _modules: list[FleetModule]  # every model set up, as your loop holds it
    _seed: int | None  # Fleet(seed=)
    _steps: StepTracker
    _dtypes: ForwardDtypes  # what a set-up model's forward converts
    call: Callable[..., None]  # your callbacks' hooks (FleetLogs.call)
    strategy: Any  # Fabric's fabric.strategy (gpufleet.fleet.strategy.FleetStrategy)
    broadcast: Callable[..., Any]  # rank 0's object on every rank (FleetComm.broadcast)
    _accumulation: Accumulation  # Fleet(gradient_accumulation_steps=)

    def setup(self, module: nn.Module, *optimizers: torch.optim.Optimizer,
              scheduler: Any = None, move_to_device: bool = True) -> Any:
        """Place ``module`` as the run's strategy says and wrap ``optimizers`` so that
        their steps go through the run. COLLECTIVE (ddp broadcasts rank 0's weights).

        Each optimizer comes back as a :class:`~gpufleet.fleet.wrappers.FleetOptimizer`
        around your own object (``wrapped.optimizer is optimizer``), which keeps
        training, as with Fabric, wherever the strategy trains the parameters you built
        it on (single, ddp, dp). A strategy that shards or replaces the parameters
        (fsdp, tensor and pipeline parallel) or the optimizer (zero1, local_sgd,
        horovod) builds a new one of your class on the placed parameters (by name:
        groups and settings kept, state not), and ``.optimizer`` is that one.

        ``scheduler`` (Fabric's): an LR scheduler built on one of ``optimizers``,
        returned last; where that optimizer was rebuilt, it is moved onto the new one
        (with the schedulers it chains), so that its learning rates reach training.

        ``move_to_device=False`` (Fabric's: leave the model where it is) is taken where
        nothing would move: the module's parameters and buffers are all on this rank's
        device already. Elsewhere it is refused: the strategy trains the model on this
        rank's device (DDP, FSDP and the precision work there).

        Returns:
            The model (a :class:`FleetModule`), ``(model, *optimizers)``, or with a
            ``scheduler``, ``(model, *optimizers, scheduler)``.

        Raises:
            ValueError: the model or an optimizer was set up already (as Fabric's).
        """
        _check_not_set_up(module, optimizers, "setup")
        return self._setup(module, optimizers, scheduler, move_to_device, "setup")

    def _setup(self, module: nn.Module, optimizers: tuple, scheduler: Any,
               move_to_device: bool, call: str) -> Any:
        run = self._rank_run()
        if not move_to_device:
            _check_in_place(module, run.device)
        scheduled = _scheduled_index(scheduler, optimizers)
        from gpufleet.parallel.parallelize import parallelize  # heavy: layer options

        module = self._dtypes.convert_module(module)  # the true precisions' dtype
        # What rebuilds each optimizer by parameter name, read before placing (a
        # strategy that rebuilds it places new parameters)
        specs = [spec_from_optimizer(opt, module) for opt in optimizers]
        placed = parallelize(module, run.strategy, run.cfg, run.env.world_size)
        self._placed.append(placed)
        if run.model is None:  # the run's model until an optimizer names its own
            run.model = placed
        # A pipeline stage: evaluation forwards run every stage in turn (COLLECTIVE)
        whole = run.strategy.eval_model(placed) if run.strategy.traits.pipelined else None
        wrapped = FleetModule(placed, run.strategy.unwrap(placed),
                              self._steps.phase_announce, run.precision,
                              device=run.device, dtypes=self._dtypes, whole=whole,
                              guard=self._guard)
        self._modules.append(wrapped)  # (placed again after a lost node: recovery.py)
        built = [self._adopt(placed, opt, spec, scheduled_here=i == scheduled)
                 for i, (opt, spec) in enumerate(zip(optimizers, specs, strict=True))]
        wrappers = self._take_optimizers(placed, built)
        if call == "setup":  # Fabric's setup calls this hook; its setup_module does not
            self.call("on_after_setup", fabric=self, module=wrapped)
        if scheduled is not None:
            if built[scheduled] is not optimizers[scheduled]:
                scheduler = place_scheduler(scheduler, built[scheduled])
            if built[scheduled] is run.optimizer:  # the primary's: the run's scheduler
                run.scheduler = scheduler
                for part in run.parts:
                    part.scheduler = scheduler
            return (wrapped, *wrappers, scheduler)
        return wrapped if not wrappers else (wrapped, *wrappers)

    def _adopt(self, placed: nn.Module, optimizer: torch.optim.Optimizer,
               spec: Any = None, scheduled_here: bool = False) -> torch.optim.Optimizer:
        """The optimizer the run steps for yours: yours itself where the strategy keeps
        the parameters it holds and adds nothing to an optimizer; else one the strategy
        builds on the placed parameters."""
        run = self._rank_run()
        own = {id(p) for p in run.strategy.unwrap(placed).parameters()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if run.strategy.keeps_optimizer() and all(id(p) in own for p in held):
            return optimizer
        spec = spec or spec_from_optimizer(optimizer, run.strategy.unwrap(placed))
        if not scheduled_here:
            _warn_if_scheduled(optimizer)
        return run.strategy.setup_optimizer(placed, spec)

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> FleetModule:
        """:meth:`setup` without an optimizer: build it afterwards on the returned
        model's parameters (sharded ones, under fsdp) and pass it to
        :meth:`setup_optimizers`."""
        _check_not_set_up(module, (), "setup_module")
        return self._setup(module, (), None, move_to_device, "setup_module")

    def setup_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """Optimizers made ready as :meth:`setup` makes them, each wrapped around your
        own object (or, where the strategy rebuilds it: zero1 shards it, local_sgd
        averages, one built on the parameters of a model :meth:`setup_module`
        returned). Use the ones returned: the optimizer, or a tuple of them.

        Raises:
            ValueError: no optimizer given, or one set up already (as Fabric's).
        """
        run = self._rank_run()
        if not optimizers:
            raise ValueError("`setup_optimizers` requires at least one optimizer as input: "
                             "fleet.setup_optimizers(optimizer).")
        _check_not_set_up(None, optimizers, "setup_optimizers")
        wrappers = []
        for opt in optimizers:
            params = {id(p) for group in opt.param_groups for p in group["params"]}
            owner = next((m for m in self._placed
                          if params <= {id(p) for p in m.parameters()}), None)
            if owner is not None:
                wrappers += self._take_optimizers(owner, [self._adopt(owner, opt)])
            elif run.strategy.keeps_optimizer():  # Fabric steps any optimizer as it is
                wrappers += self._take_optimizers(None, [opt])
            else:
                raise ConfigError(
                    f"setup_optimizers: this {type(opt).__name__} holds parameters of no "
                    f"model set up by this Fleet, and strategy {run.strategy.name!r} builds "
                    "the optimizer on the placed parameters. Build it on the parameters of "
                    "the model setup_module returned, or pass model and optimizer to "
                    "fleet.setup(model, optimizer).")
        return wrappers[0] if len(wrappers) == 1 else tuple(wrappers)

    def _take_optimizers(self, placed: nn.Module | None, optimizers: list
                         ) -> list[FleetOptimizer]:
        """The first optimizer of the run is the primary one (its steps are the run's
        steps, the non-finite guard watches its model); every step goes through the
        run. Returns each wrapped."""
        run, steps = self._rank_run(), self._steps
        out = []
        for opt in optimizers:
            primary = run.optimizer is None
            if primary:
                if placed is not None:
                    run.model = placed
                run.optimizer = opt
                if run.cfg.fault.skip_nonfinite and run.model is not None:
                    run.nonfinite = NonFiniteGuard(run.cfg.fault, run.strategy,
                                                   run.precision)
                if run.model is not None:  # the run's part: what its step and guard read
                    run.parts = [ModelPart(
                        "model", run.model, opt, None, run.precision, run.nonfinite,
                        [p for p in run.model.parameters() if p.requires_grad])]
            step = steps.primary_step if primary else steps.other_step
            out.append(FleetOptimizer(opt, self._with_callbacks(step),
                                      steps.on_zero_grad if primary else None,
                                      acts=lambda: self._accumulation.sync))
            watch_direct_steps(opt, steps.inside_step, steps.direct_step_begins,
                               functools.partial(steps.direct_step_ended, primary))
        return out

    def _with_callbacks(self, step: Any) -> Any:
        """``step`` followed by Fabric's ``on_after_optimizer_step`` hook of your
        callbacks (what Fabric's optimizer wrapper calls after each step)."""
        def stepped(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
            if not self._accumulation.sync:  # accumulate(): not this micro-batch
                return None
            out = step(optimizer, closure)
            self.call("on_after_optimizer_step", strategy=self.strategy, optimizer=optimizer)
            return out
        return stepped

    def setup_dataloaders(self, *loaders: Any, use_distributed_sampler: bool = True,
                          move_to_device: bool = True, order: str = "distributed") -> Any:
        """Each loader sharded over the ranks with a resumable sampler (its position is
        saved by :meth:`save`), its batches moved to this rank's device.

        A loader that shuffled is shuffled per epoch as torch's
        ``DistributedSampler(seed=run.seed)`` would on several ranks, and as its own
        ``RandomSampler`` would in a job of one process; a sampler of your own
        (weighted, a subset) keeps its draws, sharded over the ranks as Fabric shards
        them.

        A loader over an ``IterableDataset`` (a stream) on several ranks is shared out:
        each rank, and each of its workers, reads its own batches of the stream, every
        item once, and :meth:`save` records the position (see
        :mod:`~gpufleet.fleet.stream`; the stream must give every process the same
        items, not split itself by worker or rank).

        In a job of one process, a loader that cannot be rebuilt so (an
        ``IterableDataset``, a dataset or sampler without ``len()``, a batch sampler of
        its own) is left as it is, as Fabric leaves every loader on one device: it
        iterates as before, and :meth:`save` keeps the loader's own ``state_dict``
        where it has one (torchdata's ``StatefulDataLoader``), else no position.

        ``order="accelerate"``: on several ranks, Accelerate's order instead (whole
        batches of one order dealt to the ranks in turn, the last round completed from
        the epoch's first samples; :mod:`gpufleet.fleet.order`): each rank reads the
        samples ``accelerator.prepare`` gives it, for a loader that shuffles or reads
        in order. A shuffling loader's generator is seeded here from torch's random
        state, as Accelerate's ``prepare`` seeds it, and rank 0's is used on every
        rank (COLLECTIVE). In one process both orders are the loader's own.

        Returns:
            One :class:`~gpufleet.fleet.loader.FleetLoader`, or a tuple of them.

        Raises:
            ValueError: no loader given, or one set up already, or an unknown
                ``order``, or ``order="accelerate"`` with a sampler of your own;
                TypeError: not a ``DataLoader`` (as Fabric's).
        """
        run = self._rank_run()
        if order not in ORDERS:
            raise ConfigError(unknown_choice("setup_dataloaders(order=...)", order, ORDERS))
        if not loaders:
            raise ValueError("`setup_dataloaders` requires at least one dataloader as input: "
                             "fleet.setup_dataloaders(loader).")
        if any(isinstance(loader, FleetLoader) for loader in loaders):
            raise ValueError("A dataloader should be passed only once to the "
                             "`setup_dataloaders` method: one given is what "
                             "setup_dataloaders returned already; use it as it is.")
        wrong = next((x for x in loaders if not isinstance(x, DataLoader)), None)
        if wrong is not None:
            raise TypeError("Only PyTorch DataLoader are currently supported in "
                            f"`setup_dataloaders` (got a {type(wrong).__name__}): give "
                            "torch.utils.data.DataLoader objects.")
        shard, shards = run.strategy.data_shard(run.env.rank, run.env.world_size)
        # Fleet(seed=), else the seed seed_everything chose (as Fabric's sampler), else
        # run.seed
        seed = run.cfg.run.seed if self._seed is not None else chosen_seed(run.cfg.run.seed)
        out = []
        for loader in loaders:
            sampler: Any = None
            wrap = FleetLoader
            if use_distributed_sampler and _streams(loader, shards, run.env.world_size):
                # each rank (and worker) its own chunks of the stream: fleet/stream.py
                loader, sampler = shard_stream(loader, rank=shard, world_size=shards)
                wrap = FleetStreamLoader
            elif use_distributed_sampler:
                dealt = self._accelerate_order(loader, shards) \
                    if order == "accelerate" and shards > 1 else None
                try:
                    loader, sampler = shard_loader(loader, rank=shard, world_size=shards,
                                                   seed=seed, order=dealt)
                except ConfigError:
                    if shards > 1 or run.env.world_size > 1:
                        raise
                    log.debug("one process: this loader is left as it is (no position "
                              "to save), as Fabric leaves it")
            if seeds_workers():  # seed_everything(workers=True), Fabric's default
                add_worker_seeding(loader, run.env.rank)
            mover = None
            if move_to_device and run.device.type != "cpu":
                device = run.device
                mover = lambda batch, d=device: to_device(batch, d, non_blocking=True)  # noqa: E731
            fleet_loader = wrap(loader, sampler, self._steps.on_batch, mover,
                                device=run.device if move_to_device else None)
            self._loaders.add(fleet_loader, data_copies=run.env.world_size // shards)
            out.append(fleet_loader)
        return out[0] if len(out) == 1 else tuple(out)


    def _accelerate_order(self, loader: Any, shards: int) -> AccelerateOrder:
        """Accelerate's order of ``loader`` over ``shards`` ranks, its generator seeded
        as ``prepare`` seeds it and taken from rank 0 (COLLECTIVE where it shuffles)."""
        theirs = getattr(loader, "sampler", None)
        if not isinstance(theirs, (RandomSampler, SequentialSampler)) or \
                getattr(loader, "batch_size", None) is None:
            raise ConfigError(
                f"setup_dataloaders(order='accelerate') takes a loader that shuffles "
                f"(shuffle=True) or reads in order, with a batch_size; this one has a "
                f"{type(theirs).__name__}. Use order='distributed' (the default), or "
                "use_distributed_sampler=False and shard it yourself.")
        state = None
        if isinstance(theirs, RandomSampler):
            drawn = accelerate_generator_state(theirs).tolist()
            state = torch.tensor(self.broadcast(drawn, 0), dtype=torch.uint8)  # COLLECTIVE
        return AccelerateOrder(theirs, batch_size=loader.batch_size, world_size=shards,
                               drop_last=loader.drop_last, generator_state=state)


def _streams(loader: DataLoader, shards: int, world_size: int) -> bool:
    """Whether ``loader`` reads a stream that Fleet shares out over the ranks (on one
    process a stream is left as Fabric leaves it: as it is)."""
    return isinstance(loader.dataset, IterableDataset) and (shards > 1 or world_size > 1)


def _check_not_set_up(module: Any, optimizers: tuple, call: str) -> None:
    """Fabric's misuse errors, in its words (a Fabric loop's tests match them): a model
    or optimizer handed to ``call`` a second time."""
    if isinstance(module, FleetModule):
        raise ValueError(f"A model should be passed only once to the `{call}` method: this "
                         f"one is what {call} returned already; use it as it is.")
    if any(isinstance(opt, FleetOptimizer) for opt in optimizers):
        raise ValueError(f"An optimizer should be passed only once to the `{call}` method: "
                         f"one given is what {call} returned already; use it as it is.")


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
