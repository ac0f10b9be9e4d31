"""Build a training run from its plan, once: :func:`build_run`.

The order is fixed here and each step is one function: the run's plan (made by the
launching process, see :mod:`gpufleet.plan`) and process group → device and backend
flags → precision, parallel strategy over the plan's mesh degrees, model, optimizer →
run directory → data → schedule → checkpointer and evaluator → monitors → callbacks.
What comes out is a :class:`~gpufleet.train.engine.run.Run` whose parts the loop only uses.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from gpufleet.config import Config, write_config
from gpufleet.core.callbacks import Callback, CallbackList
from gpufleet.core.phases import PhaseAnnouncer
from gpufleet.data.ledger import open_ledger
from gpufleet.data.loaders import build_eval_loader, build_stream_loader, build_train_loader
from gpufleet.errors import ConfigError, GpufleetError
from gpufleet.fault.preempt import PREEMPT_SIGNALS
from gpufleet.job import import_object
from gpufleet.launch import DistEnv, broadcast_object, is_initialized
from gpufleet.launch.grow import joining
from gpufleet.launch.rankmain import restarts
from gpufleet.monitor.flops import device_peak_flops
from gpufleet.monitor.system import SystemSampler
from gpufleet.parallel import build_strategy, strategy_class
from gpufleet.parallel.compile_cache import keep_compile_cache
from gpufleet.parallel.parallelize import parallelize
from gpufleet.plan import RunPlan, make_plan
from gpufleet.precision import build_precision
from gpufleet.procs import record_process
from gpufleet.train.checkpoint import runlock
from gpufleet.train.checkpoint.checkpointer import Checkpointer
from gpufleet.train.checkpoint.keeping import check_monitor
from gpufleet.train.checkpoint.modelrecord import record_transformers_model
from gpufleet.train.checkpoint.rundir import plan_and_lock
from gpufleet.train.engine.batches import make_loss_fn
from gpufleet.train.engine.evaluator import Evaluator
from gpufleet.train.engine.monitors import build_monitors, own_callbacks
from gpufleet.train.engine.resilience import BuiltInLoopState, recovery_of
from gpufleet.train.engine.run import ModelPart, Run, TrainState
from gpufleet.train.engine.steps import UserStep, models_and_step, per_model
from gpufleet.train.engine.stream import TrainStream
from gpufleet.train.engine.view import DataCounts, RunView
from gpufleet.train.evalmetrics import EvalMetric, build_metrics
from gpufleet.train.guard.nonfinite import NonFiniteGuard
from gpufleet.train.optim import (
    build_scheduler,
    describe_schedule,
    fill_optimizer_defaults,
    optimizer_spec,
)
from gpufleet.train.perf import apply_backend_flags, share_cores
from gpufleet.train.rank import join_process_group, local_gpu_index
from gpufleet.train.recipe import (
    describe_scheduler,
    place_scheduler,
    recipe_line,
    spec_from_optimizer,
    user_optimizer,
)
from gpufleet.train.recovery.reshard import reshardable, source_of
from gpufleet.train.scheduling import check_eval_scheduler, steps_on_eval
from gpufleet.train.seed import seed_everything, set_deterministic

log = logging.getLogger(__name__)


def build_run(plan: RunPlan | Config, model: nn.Module | Mapping[str, nn.Module],
              train_data: Dataset, eval_data: Dataset | None = None, *,
              loss_fn: Any = None, callbacks: Sequence[Callback] = (),
              eval_metrics: Mapping[str, Any] | None = None,
              optimizer: Any = None, scheduler: Any = None,
              training_step: Any = None) -> Run:
    """Build every part of a training run on this rank (COLLECTIVE: every rank calls it).

    Args:
        plan: the run's plan (:func:`gpufleet.plan.make_plan`), or a config, which is
            then planned here for this process (the one resolve of this rank).
        model: your ``nn.Module``, built identically on every rank; or several, as a
            dict ``{name: module}`` (a GAN's generator and discriminator), trained by
            ``training_step``.
        train_data: a map-style ``Dataset`` of ``(inputs, target)``, argument tuples or
            dicts; or a stream (an ``IterableDataset``), each rank its share of it
            (:class:`~gpufleet.data.stream_shard.StreamShard`).
        eval_data: optional evaluation ``Dataset`` (or stream).
        loss_fn: ``loss(model_output, target)``; omit when the model returns its loss.
        callbacks: yours, after the run's own.
        eval_metrics: ``{name: fn(output, target)}`` besides ``eval.metrics``.
        optimizer: your optimizer (a ``torch.optim`` object on ``model``'s parameters,
            parameter groups welcome) or a factory ``fn(params)``; instead of
            ``[optim]``'s (see :mod:`gpufleet.train.recipe`).
        scheduler: your LR scheduler (an object on that optimizer, or ``fn(optimizer)``),
            stepped every optimizer step or, with ``sched.interval = "epoch"``, every epoch.
            With several models: a dict by model name, or a factory called per model.
        training_step: your ``fn(models, batch, step)`` returning the loss or a dict of
            losses (:mod:`gpufleet.train.engine.steps`); None: ``loss_fn`` (or the model's
            own loss) on each batch.

    Returns:
        The :class:`~gpufleet.train.engine.run.Run`; train it with
        ``Trainer(run).fit()``.
    """
    env = DistEnv.detect()
    if isinstance(plan, Config):  # called directly: this process is the rank to build
        # A run without a name is named after the model (gpufleet.fit(MLP(), ...): mlp).
        plan = make_plan(plan, env, model=model, here=True)
    plan = plan.for_world(env)
    # A rank started to join live ranks builds alone: no process group, no collective,
    # a strategy for one rank; it meets them before its first step (Recovery.join).
    join = joining()
    if env.is_distributed and not is_initialized() and join is None:
        join_process_group(plan, env)  # else its entry joined already
    cfg = plan.cfg
    models, training_step = models_and_step(cfg, model, training_step, eval_data)
    share_cores(env.local_world_size, env.is_main)
    device = rank_device(cfg, env)
    precision, strategy = precision_and_strategy(cfg, plan.dims, device, join is not None)
    cfg, placed = _place_models(cfg, env, device, strategy, models, optimizer, scheduler)
    model, optimizer, scheduler, _ = next(iter(placed.values()))
    metrics = _eval_metrics(cfg, eval_metrics)  # before the run directory: may fail
    for name in (cfg.early_stop.metric, cfg.checkpoint.keep_best and cfg.checkpoint.monitor):
        if name:
            check_monitor(name, has_eval=eval_data is not None)
    precisions, guards = _scalers_and_guards(cfg, device, strategy, precision, list(placed))
    nonfinite = next(iter(guards.values()))
    # Every rank now draws different dropout masks; data order comes from the sampler's
    # own generator and is independent of this.
    seed_everything(cfg.run.seed + env.rank)
    if join is None:
        cfg, resume_from, run_lock = plan_run_dir(cfg, env)  # COLLECTIVE
    else:  # the live ranks' run directory, written already; their state, not a file
        resume_from, run_lock = None, None
        record_process(Path(cfg.run.dir), "rank", env.rank)
    run_dir = Path(cfg.run.dir)
    if env.is_main and len(models) == 1:  # a Transformers model: its class and config
        record_transformers_model(next(iter(models.values())), run_dir)
    data, eval_loader = _data(cfg, env, device, strategy, train_data, eval_data)
    max_steps = _max_steps(cfg, env, data)
    parts = [ModelPart(name, placed_model, opt,
                       # the [optim] schedule (constant for the "none" preset)
                       sched if sched is not None else build_scheduler(opt, cfg.optim,
                                                                       max_steps),
                       precisions[name], guards[name],
                       [p for p in placed_model.parameters() if p.requires_grad], source)
             for name, (placed_model, opt, sched, source) in placed.items()]
    scheduler = parts[0].scheduler
    for part in parts:  # before any step: a scheduler stepped on the eval loss needs one
        check_eval_scheduler(part.scheduler, eval_loader is not None and
                             bool(cfg.run.eval_every))
    loss = make_loss_fn(loss_fn)
    evaluator = None if eval_loader is None else Evaluator(
        eval_loader, model, strategy, precision, loss, metrics,
        device=device, pin_memory=data.pin_memory, channels_last=cfg.perf.channels_last,
        max_batches=cfg.run.eval_batches, data_copies=data.data_copies)
    mon = cfg.monitor
    run = Run(
        cfg=cfg, env=env, device=device, run_dir=run_dir, precision=precision,
        strategy=strategy, model=model, optimizer=optimizer, scheduler=scheduler,
        loss_fn=loss, data=data, counts=data, evaluator=evaluator,
        checkpointer=Checkpointer(run_dir, env, cfg, model, optimizer, scheduler, strategy,
                                  precision, data.sampler, parts),
        nonfinite=nonfinite, max_steps=max_steps,
        peak_flops=device_peak_flops(cfg, device), resume_from=resume_from,
        run_lock=run_lock, monitors=build_monitors(cfg, env, device, run_dir),
        # FLOPs per step: counted on the second step (None: not yet; 0: not counted).
        state=TrainState(flops_per_step=None if (mon.phases or mon.diagnose) else 0),
        parts=parts,
        user_step=None if training_step is None else UserStep(training_step, list(placed)))
    run.result.run_dir = str(run_dir)
    if data.data_copies == 1:  # (pipeline stages read the same samples: not kept there)
        data.ledger = open_ledger(run_dir, run.state, data.sampler, env.restart_count)
    run.view = RunView(run)  # what callbacks get: read-only, reads live values
    run.loop_state = BuiltInLoopState(run)  # what snapshots capture
    attach_callbacks(run, callbacks)
    run.recovery = recovery_of(run, join, plan.backend)
    return run


def build_own_loop_run(plan: RunPlan, env: DistEnv, counts: DataCounts) -> Run:
    """The :class:`~gpufleet.train.engine.run.Run` of your own loop on this rank
    (:class:`~gpufleet.Fleet`; COLLECTIVE: every rank calls it, in the process group
    already): device and backend flags, precision and strategy, the run directory
    (rank 0 chooses and locks it) and the monitors, made by the very steps of
    :func:`build_run`. Your loop brings the rest: ``Fleet.setup`` places the model and
    fills in the model, optimizer and parts, ``counts`` are the loaders it sets up, and
    its first step attaches the callbacks (:func:`attach_callbacks`). What only the
    built-in loop has (its data stream, evaluator, checkpointer, training step) stays
    None. Nothing is seeded here: your loop's random state is its own."""
    cfg = plan.cfg
    device = rank_device(cfg, env)
    precision, strategy = precision_and_strategy(cfg, plan.dims, device)
    cfg, resume_from, run_lock = plan_run_dir(cfg, env)  # COLLECTIVE
    run_dir = Path(cfg.run.dir)
    run = Run(cfg=cfg, env=env, device=device, run_dir=run_dir, precision=precision,
              # SIGTERM and SIGUSR1 (Ctrl-C stays your loop's KeyboardInterrupt)
              strategy=strategy,
              monitors=build_monitors(cfg, env, device, run_dir, PREEMPT_SIGNALS),
              counts=counts, resume_from=resume_from, run_lock=run_lock,
              # FLOPs are not counted: your loop's forward is not the engine's to wrap
              state=TrainState(flops_per_step=0))
    run.result.run_dir = str(run_dir)
    run.view = RunView(run)
    return run


def attach_callbacks(run: Run, callbacks: Sequence[Callback]) -> None:
    """The run's own callbacks (:func:`~gpufleet.train.engine.monitors.own_callbacks`),
    then ``callbacks``, and the phase announcer that tells them a phase begins; for both
    loops (your loop's at its first step, when its loaders are known)."""
    run.callbacks = CallbackList(own_callbacks(run) + list(callbacks))
    if run.monitors.system_sampler is None:  # one the caller added (its own interval)
        run.monitors.system_sampler = next(
            (cb for cb in callbacks if isinstance(cb, SystemSampler)), None)
    run.phases = PhaseAnnouncer(run.callbacks.phase_listeners, run.view,
                                run.callbacks.mark_readers)


def rank_device(cfg: Config, env: DistEnv) -> torch.device:
    """This rank's device, with the determinism and backend flags the config asks for."""
    if cfg.run.device == "cuda":
        # A one-process strategy (dp drives every GPU from it) starts on GPU 0.
        one_process = strategy_class(cfg.parallel.strategy).traits.one_process
        device = torch.device("cuda", 0 if one_process else local_gpu_index(env))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    set_deterministic(cfg.run.deterministic)
    apply_backend_flags(cfg.perf, cfg.run.deterministic)
    return device


def precision_and_strategy(cfg: Config, dims: Any, device: torch.device,
                           joins: bool = False) -> tuple[Any, Any]:
    """Mixed precision, and the strategy that applies the plan's mesh degrees (``dims``,
    over one DeviceMesh) to the model. ``joins``: this rank joins live ranks, and builds
    for one rank until it meets them."""
    precision = build_precision(cfg.precision.mode, device.type, cfg.precision)
    strategy = build_strategy(cfg.parallel.strategy, cfg.parallel, device, precision, dims)
    if joins:
        strategy.regroup(1)  # wrapped for the whole world when it joins
    elif strategy.needs_process_group and not is_initialized():
        raise ConfigError(
            f"parallel.strategy = {cfg.parallel.strategy!r} needs a process group, and "
            "this process was started alone. Use --nproc N (or torchrun), or "
            "parallel.strategy=single for one process.")
    return precision, strategy


def _place_models(cfg: Config, env: DistEnv, device: torch.device, strategy: Any,
                  models: dict[str, nn.Module], optimizer: Any, scheduler: Any
                  ) -> tuple[Config, dict[str, tuple[nn.Module, Any, Any, Any]]]:
    """Each model placed by the strategy with its optimizer and scheduler (yours, by
    model name or a factory per model; else ``[optim]``'s); the config with the first
    model's filled-in settings and every model's recipe (``name: ... || name: ...``)."""
    optimizers = per_model(optimizer, list(models), "optimizer")
    schedulers = per_model(scheduler, list(models), "scheduler")
    several = len(models) > 1
    placed: dict[str, tuple[nn.Module, Any, Any, Any]] = {}
    recipes, cfgs = [], []
    for name, module in models.items():
        named_cfg, *rest = _model_and_optimizer(
            cfg, env, device, strategy, module, optimizers[name], schedulers[name],
            name if several else "")
        placed[name] = (rest[0], rest[1], rest[2], rest[3])
        recipes.append(f"{name}: {named_cfg.optim.recipe}" if several
                       else named_cfg.optim.recipe)
        cfgs.append(named_cfg)
    first = cfgs[0]
    return dataclasses.replace(first, optim=dataclasses.replace(
        first.optim, recipe=" || ".join(recipes))), placed


def _scalers_and_guards(cfg: Config, device: torch.device, strategy: Any, precision: Any,
                        names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One loss scaler (precision object) and one non-finite guard per model, the first
    model's being the run's own; several guards decide on the host, each on its model."""
    precisions = {name: precision if i == 0 else
                  build_precision(cfg.precision.mode, device.type, cfg.precision)
                  for i, name in enumerate(names)}
    clip_by_norm = bool(cfg.optim.clip_norm and not cfg.optim.clip_value)
    guards = {name: NonFiniteGuard(cfg.fault, strategy, precisions[name],
                                   clip_by_norm=clip_by_norm, device_path=len(names) == 1)
              if cfg.fault.skip_nonfinite else None for name in names}
    return precisions, guards


def _eval_metrics(cfg: Config, extra: Mapping[str, Any] | None) -> list[EvalMetric]:
    """``eval.metrics`` (importing the user's functions it names), then ``extra``."""
    metrics = build_metrics(cfg.eval.metrics)
    return metrics + [EvalMetric(name, fn) for name, fn in (extra or {}).items()]


def _model_and_optimizer(cfg: Config, env: DistEnv, device: torch.device, strategy: Any,
                         model: nn.Module, optimizer: Any = None, scheduler: Any = None,
                         name: str = "") -> tuple[Config, nn.Module, Any, Any, Any]:
    """The model as the strategy places it, its optimizer (yours, or ``[optim]``'s),
    your scheduler if any, and where the model's state is sharded and in-process
    recovery is on, what it is built from again (a
    :class:`~gpufleet.train.recovery.reshard.Source`); the config gains the settings its preset
    filled in and the recipe line, so the run directory's config.toml records what was
    used."""
    if optimizer is None and cfg.optim.factory:  # your factory, named in the config
        optimizer = import_object(cfg.optim.factory, "optim.factory")
    if scheduler is None and cfg.sched.factory:
        scheduler = import_object(cfg.sched.factory, "sched.factory")
    optim = cfg.optim
    if optimizer is not None and optim.preset == "auto":
        optim = dataclasses.replace(optim, preset="none")  # your optimizer is the recipe
    optim = fill_optimizer_defaults(optim, model)
    if scheduler is not None and (optim.warmup_steps or optim.decay != "constant"):
        raise ConfigError(
            f"a scheduler of your own and optim's schedule (warm-up {optim.warmup_steps}, "
            f"decay {optim.decay!r}) would both set the learning rate. Drop one: "
            "optim.warmup_steps=0 and optim.decay=constant keep yours.")
    spec = (optimizer_spec(optim, device.type) if optimizer is None
            else spec_from_optimizer(user_optimizer(optimizer, model), model))
    # Tensor parallel, layer options, compile, then sharding/replication and the
    # pipeline split, in that order (gpufleet.parallel.parallelize); your optimizer's
    # groups are found again by parameter name on what it placed.
    fault = cfg.fault
    # (also at one rank: an elastic run down to one node takes a returning one in)
    source = source_of(model, spec) if (fault.recover_in_process and fault.snapshot_every
                                        and reshardable(strategy)) else None
    model = parallelize(model, strategy, cfg, env.world_size)
    built = strategy.setup_optimizer(model, spec)
    scheduler = place_scheduler(scheduler, built)
    when = ("after each evaluation, on the eval loss" if steps_on_eval(scheduler)
            else f"every {cfg.sched.interval}")
    schedule = (describe_schedule(optim) if scheduler is None else
                f"{describe_scheduler(scheduler)} {when}")
    optim = dataclasses.replace(optim, recipe=recipe_line(
        built, schedule, dataclasses.replace(cfg, optim=optim), strategy.name,
        env.world_size))
    if env.is_main:
        log.info("recipe%s: %s", f" ({name})" if name else "", optim.recipe)
    return dataclasses.replace(cfg, optim=optim), model, built, scheduler, source


def plan_run_dir(cfg: Config, env: DistEnv) -> tuple[Config, Path | None, runlock.RunLock | None]:
    """Rank 0 plans the run directory (new, or the one to resume) and locks it; every
    rank takes its plan (COLLECTIVE). Returns the config as written there, the
    checkpoint to resume from, and the lock (rank 0's, when its launcher holds none)."""
    plan: Any = None
    lock: runlock.RunLock | None = None
    if env.is_main:
        try:
            # The lock is None when this run's launcher holds it (train.checkpoint.runlock).
            # A restart of the agent's (also one for a node that joined) resumes.
            cfg_main, resume_from, lock = plan_and_lock(cfg, restarts(env.restart_count))
            plan = (cfg_main, resume_from)
            write_config(cfg_main, Path(cfg_main.run.dir) / "config.toml")
        except (GpufleetError, OSError) as e:
            plan = e
    # COLLECTIVE: a rank 0 that failed here must not leave the others waiting in the
    # next collective: they all raise its error.
    plan = broadcast_object(plan)
    if isinstance(plan, Exception):
        raise plan
    cfg, resume_from = plan
    # Before the first compile: a restarted rank reads what its predecessor compiled.
    keep_compile_cache(cfg.run.dir, cfg.perf.compile)
    # By pid, so `gpufleet cleanup RUN_DIR` can end this rank (and its data-loader
    # workers) if the run is left hanging; removed again when training ends well.
    record_process(Path(cfg.run.dir), "rank", env.rank)
    return cfg, resume_from, lock


def _data(cfg: Config, env: DistEnv, device: torch.device, strategy: Any,
          train_data: Dataset, eval_data: Dataset | None
          ) -> tuple[TrainStream, Any]:
    """This rank's share of the training and evaluation data: of a map-style data set
    through a resumable sampler, of a stream (an ``IterableDataset``) through its share
    (``data/stream_shard.py``, as Fleet's loaders)."""
    pin_memory = cfg.data.pin_memory and device.type == "cuda"
    # Data-parallel shard of this rank: every rank for ddp; ranks that hold different
    # stages of one model replica (pipeline) read the same data.
    shard, shards = strategy.data_shard(env.rank, env.world_size)
    if isinstance(train_data, IterableDataset):
        train = build_stream_loader(train_data, cfg, rank=shard, world_size=shards,
                                    pin_memory=pin_memory)
    else:
        train = build_train_loader(train_data, cfg.data, rank=shard, world_size=shards,
                                   seed=cfg.run.seed, pin_memory=pin_memory)
    eval_loader = build_eval_loader(eval_data, cfg.data, rank=shard, world_size=shards,
                                    pin_memory=pin_memory)
    stream = TrainStream(train, device, seed=cfg.run.seed, rank=env.rank,
                         pin_memory=pin_memory, device_prefetch=cfg.data.device_prefetch,
                         channels_last=cfg.perf.channels_last,
                         data_copies=env.world_size // shards)
    return stream, eval_loader


def _max_steps(cfg: Config, env: DistEnv, data: TrainStream) -> int:
    """The step the run ends at: run.max_steps or the steps of run.max_epochs, whichever
    comes first (resolve() makes sure there is a limit)."""
    run, accum = cfg.run, cfg.optim.grad_accum
    limits = [run.max_steps] if run.max_steps else []
    if run.max_epochs:
        batches = sum(data.batches_in_epoch(e) for e in range(run.max_epochs))
        if batches < accum:
            raise ConfigError(
                f"run.max_epochs = {run.max_epochs} gives {batches} batch(es) per rank, "
                f"fewer than optim.grad_accum = {accum} per optimizer step. Train more "
                "epochs, lower optim.grad_accum or data.batch_size.")
        # An optimizer step takes grad_accum batches; a remainder is left out.
        limits.append(batches // accum)
        if env.is_main:
            log.info("%d epoch(s) = %d optimizer steps (%d batches per rank)%s",
                     run.max_epochs, batches // accum, batches,
                     f"; run.max_steps = {run.max_steps} ends the run first"
                     if run.max_steps and run.max_steps < batches // accum else "")
    return min(limits)
