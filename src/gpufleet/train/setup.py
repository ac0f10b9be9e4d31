"""Everything the loop needs before its first step, one ``_build_*`` per concern.

Order matters and is fixed here: resolved config → process group → device and seeds →
model, optimizer, precision → run directory → data → resume → sinks.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from gpufleet.config import Config, config_to_dict, write_config
from gpufleet.core.callbacks import Callback, CallbackList
from gpufleet.core.tree import to_device
from gpufleet.data.loaders import build_eval_loader, build_train_loader
from gpufleet.data.prefetch import DevicePrefetcher
from gpufleet.errors import ConfigError, GpufleetError
from gpufleet.fault.nonfinite import NonFiniteGuard
from gpufleet.fault.preempt import PreemptionWatch
from gpufleet.fault.watchdog import Watchdog
from gpufleet.launch import (
    DistEnv,
    broadcast_object,
    is_initialized,
    job_store,
)
from gpufleet.launch.netif import node_address
from gpufleet.monitor.flops import device_peak_flops
from gpufleet.monitor.phases import PhaseTimer
from gpufleet.parallel import build_strategy, strategy_class
from gpufleet.parallel.dims import plan_for
from gpufleet.precision import build_precision
from gpufleet.procs import record_process
from gpufleet.train import runlock
from gpufleet.train.batches import make_loss_fn
from gpufleet.train.checkpointer import Checkpointer, Position
from gpufleet.train.evalmetrics import build_metrics
from gpufleet.train.optim import build_scheduler, fill_optimizer_defaults, optimizer_spec
from gpufleet.train.perf import apply_backend_flags, prepare_model, share_cores
from gpufleet.train.rank import join_process_group, local_gpu_index
from gpufleet.train.result import FitResult
from gpufleet.train.rundir import named, plan_and_lock
from gpufleet.train.seed import seed_everything, set_deterministic
from gpufleet.train.view import RunView

log = logging.getLogger(__name__)


class TrainerSetup:
    """Builds the pieces of a :class:`~gpufleet.train.loop.Trainer` (see its docs)."""

    def __init__(self, cfg: Config, model: nn.Module, train_data: Dataset,
                 eval_data: Dataset | None, loss_fn: Any, callbacks: list[Callback]) -> None:
        self.env = DistEnv.detect()
        self.view = RunView(self)  # what callbacks get: read-only, reads live values
        # A run without a name is named after the model (gpufleet.fit(MLP(), ...): mlp).
        # Resolved once per rank: a config the rank's entry resolved comes back as it is.
        self.cfg = join_process_group(named(cfg, model), self.env)
        share_cores(self.env.local_world_size, self.env.is_main)
        self._build_device()
        self._build_model(model, loss_fn)
        self._build_run_dir()
        self._build_data(train_data, eval_data)
        self._build_schedule()
        self.step, self.epoch, self.consumed = 0, 0, 0
        self._saved_step = -1
        mon = self.cfg.monitor
        self.phase_timer = PhaseTimer(self.device) if mon.phases else None
        # FLOPs per step: counted on the first step (None: not yet; 0: not counted).
        self.flops_per_step: int | None = None if (mon.phases or mon.diagnose) else 0
        self.peak_flops = device_peak_flops(self.cfg, self.device)
        self.watchdog = (Watchdog(self.cfg.fault, self.run_dir, self.env.rank,
                                  self.env.world_size, job_store(), self.env.restart_count,
                                  node=(self.env.node_rank, node_address(self.env)))
                         if self.cfg.fault.watchdog else None)
        self.result = FitResult(run_dir=str(self.run_dir))
        self.preemption = (PreemptionWatch(self.cfg.fault.preempt_check_every,
                                           is_initialized())
                           if self.cfg.fault.preempt_check_every else None)
        # Samples and tokens read since the last log line (host ints, from batch shapes).
        self._interval_samples, self._interval_tokens = 0, 0
        self._fixed_tokens: int | None = None  # tokens per batch when batches are fixed
        self._train_time, self._samples_seen, self._tokens_seen = 0.0, 0, 0
        self.grad_norm = torch.zeros((), device=self.device)
        self.checkpointer = Checkpointer(
            self.run_dir, self.env, self.cfg, self.model, self.optimizer, self.scheduler,
            self.strategy, self.precision, self.train_sampler)
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from)  # COLLECTIVE with sharded checkpoints
        self._last_log_step = self.step
        self._batches = self._epoch_iterator()
        self.callbacks = CallbackList(self._default_callbacks() + callbacks)
        if self.system_sampler is None:  # one the caller added (its own interval)
            from gpufleet.monitor.system import SystemSampler

            self.system_sampler = next(
                (cb for cb in callbacks if isinstance(cb, SystemSampler)), None)

    # -- builders --------------------------------------------------------------------
    def _build_device(self) -> None:
        cfg = self.cfg
        if cfg.run.device == "cuda":
            # A one-process strategy (dp drives every GPU from it) starts on GPU 0.
            one_process = strategy_class(cfg.parallel.strategy).traits.one_process
            index = 0 if one_process else local_gpu_index(self.env)
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        set_deterministic(cfg.run.deterministic)
        apply_backend_flags(cfg.perf, cfg.run.deterministic)

    def _build_model(self, model: nn.Module, loss_fn: Any) -> None:
        cfg = self.cfg
        self.precision = build_precision(cfg.precision.mode, self.device.type, cfg.precision)
        name = cfg.parallel.strategy
        dims = plan_for(cfg.parallel, strategy_class(name).traits, self.env.world_size,
                        self.env.local_world_size)
        self.strategy = build_strategy(name, cfg.parallel, self.device, self.precision, dims)
        if self.strategy.needs_process_group and not is_initialized():
            raise ConfigError(
                f"parallel.strategy = {cfg.parallel.strategy!r} needs a process group, and "
                "this process was started alone. Use --nproc N (or torchrun), or "
                "parallel.strategy=single for one process."
            )
        from gpufleet.parallel.activation_checkpointing import apply_layer_options

        # SyncBatchNorm and activation checkpointing change layers in place (same
        # state-dict names), before compilation and before the strategy wraps the model.
        model = apply_layer_options(model, cfg.parallel, self.device, self.env.world_size)
        # Optimizer settings left at -1 get the model's defaults; the run directory's
        # config.toml then records the values used.
        cfg = self.cfg = dataclasses.replace(
            cfg, optim=fill_optimizer_defaults(cfg.optim, model))
        self.model = self.strategy.setup_model(prepare_model(model, cfg.perf))
        self.optimizer = self.strategy.setup_optimizer(
            self.model, optimizer_spec(cfg.optim, self.device.type))
        self.loss_fn = make_loss_fn(loss_fn)
        self.eval_metrics = build_metrics(cfg.eval.metrics)  # imports the user's functions
        self.nonfinite = (NonFiniteGuard(cfg.fault, self.strategy, self.precision,
                                         clip_by_norm=bool(cfg.optim.clip_norm
                                                           and not cfg.optim.clip_value))
                          if cfg.fault.skip_nonfinite else None)
        # Every rank now draws different dropout masks; data order comes from the
        # sampler's own generator and is independent of this.
        seed_everything(cfg.run.seed + self.env.rank)

    def _build_run_dir(self) -> None:
        plan: Any = None
        self.run_lock: runlock.RunLock | None = None
        if self.env.is_main:
            try:
                # The lock is None when this run's launcher holds it (train.runlock).
                cfg, resume_from, self.run_lock = plan_and_lock(self.cfg,
                                                                self.env.restart_count)
                plan = (cfg, resume_from)
                write_config(cfg, Path(cfg.run.dir) / "config.toml")
            except (GpufleetError, OSError) as e:
                plan = e
        # COLLECTIVE: every rank takes rank 0's run directory, or its error: a rank 0
        # that failed here must not leave the others waiting in the next collective.
        plan = broadcast_object(plan)
        if isinstance(plan, Exception):
            raise plan
        self.cfg, self.resume_from = plan
        self.run_dir = Path(self.cfg.run.dir)
        # By pid, so `gpufleet cleanup RUN_DIR` can end this rank (and its data-loader
        # workers) if the run is left hanging; removed again when training ends well.
        record_process(self.run_dir, "rank", self.env.rank)

    def _build_data(self, train_data: Dataset, eval_data: Dataset | None) -> None:
        cfg, env = self.cfg, self.env
        if isinstance(train_data, IterableDataset):
            raise ConfigError("train_data is an IterableDataset; gpufleet needs a map-style "
                              "Dataset (__len__ and __getitem__) to shard it across ranks "
                              "and resume mid-epoch.")
        self.pin_memory = cfg.data.pin_memory and self.device.type == "cuda"
        # Data-parallel shard of this rank: every rank for ddp; ranks that hold different
        # stages of one model replica (pipeline) read the same data.
        shard, shards = self.strategy.data_shard(env.rank, env.world_size)
        self.data_copies = env.world_size // shards  # ranks reading each sample (pipeline)
        train = build_train_loader(train_data, cfg.data, rank=shard,
                                   world_size=shards, seed=cfg.run.seed,
                                   pin_memory=self.pin_memory)
        self._train = train
        self.train_loader, self.train_sampler = train.loader, train.sampler
        self._consume_unit, self._variable_batches = train.unit, train.variable
        self.eval_loader = build_eval_loader(eval_data, cfg.data, rank=shard,
                                             world_size=shards,
                                             pin_memory=self.pin_memory)

    def _build_schedule(self) -> None:
        """The step the run ends at, and the learning-rate schedule over it: run.max_steps
        or the steps of run.max_epochs, whichever comes first."""
        run, accum = self.cfg.run, self.cfg.optim.grad_accum
        limits = [run.max_steps] if run.max_steps else []
        if run.max_epochs:
            batches = sum(self._train.batches_in_epoch(e) for e in range(run.max_epochs))
            if batches < accum:
                raise ConfigError(
                    f"run.max_epochs = {run.max_epochs} gives {batches} batch(es) per rank, "
                    f"fewer than optim.grad_accum = {accum} per optimizer step. Train more "
                    "epochs, lower optim.grad_accum or data.batch_size.")
            # An optimizer step takes grad_accum batches; a remainder is left out.
            limits.append(batches // accum)
            if self.env.is_main:
                log.info("%d epoch(s) = %d optimizer steps (%d batches per rank)%s",
                         run.max_epochs, batches // accum, batches,
                         f"; run.max_steps = {run.max_steps} ends the run first"
                         if run.max_steps and run.max_steps < batches // accum else "")
        self.max_steps = min(limits)  # resolve() makes sure there is a limit
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optim, self.max_steps)

    @property
    def epochs_done(self) -> float:
        """Passes over the training set so far, e.g. 1.5 halfway through the second."""
        per_epoch = self._train.batches_in_epoch(self.epoch) * self._consume_unit
        return self.epoch + (self.consumed / per_epoch if per_epoch else 0.0)

    def _epoch_iterator(self) -> Any:
        """A fresh pass over the training loader for ``self.epoch``.

        The loader draws its workers' base seed from its own generator, seeded from
        (seed, rank, epoch), not from the global RNG: a resumed run then restores the
        global RNG exactly and its workers get the seeds the uninterrupted run's got.
        """
        self.train_loader.generator.manual_seed(
            self.cfg.run.seed * 1_000_003 + self.env.rank * 7919 + self.epoch)
        batches = iter(self.train_loader)
        if self.device.type != "cuda":
            return batches
        if self.cfg.data.device_prefetch:
            # Copy the next batch to the GPU on a side stream while this step computes.
            return iter(DevicePrefetcher(batches, self.device))
        # The copy runs on the compute stream when the batch is taken (data.device_prefetch
        # off: for comparison, or to rule the prefetcher out when hunting a bug).
        return (to_device(b, self.device, non_blocking=self.pin_memory) for b in batches)

    def _default_callbacks(self) -> list[Callback]:
        """The run's own callbacks, in the order they hear each hook: phase timing first
        (its clock reads bracket the others' work least), the file sinks before the
        advisor that reads what they were given."""
        from gpufleet.monitor.advisor import Advisor, SyncProbe, run_facts
        from gpufleet.monitor.jsonl import MetricsFile
        from gpufleet.monitor.profile import ProfilerCallback
        from gpufleet.monitor.sinks import build_sinks
        from gpufleet.monitor.system import SystemSampler

        cfg, env, mon = self.cfg, self.env, self.cfg.monitor
        own: list[Callback] = [cb for cb in (self.phase_timer, self.watchdog) if cb]
        if cfg.profile.steps:  # every rank writes its own trace
            own.append(ProfilerCallback(cfg.profile.steps, self.run_dir, env.rank,
                                        env.world_size))
        self.system_sampler = None
        if env.local_rank == 0 and mon.system_interval_s > 0:  # one sampler per node
            self.system_sampler = SystemSampler(self.run_dir,
                                                interval_s=mon.system_interval_s)
            own.append(self.system_sampler)
        if not env.is_main:
            return own
        metrics = MetricsFile(self.run_dir / "metrics.jsonl")
        own.append(metrics)
        own.extend(build_sinks(mon.sinks, self.run_dir, config_to_dict(cfg)))
        self.advisor = None
        if mon.diagnose and mon.phases:
            self.advisor = Advisor(run_facts(self.view), self.run_dir, metrics,
                                   self.system_sampler, phase_timer=self.phase_timer)
            own.append(self.advisor)
            if mon.sync_probe_steps and self.device.type == "cuda":
                own.append(SyncProbe(self.advisor, mon.sync_probe_steps))
        return own

    # -- checkpoints -----------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Save the full training state (:class:`~gpufleet.train.checkpointer.Checkpointer`,
        COLLECTIVE). A failed write is recorded in the result and training goes on.
        Returns the path, or None when the write failed."""
        path, error = self.checkpointer.save(Position(self.step, self.epoch, self.consumed),
                                             self.result.checkpoint)
        if error is not None:
            self.result.checkpoint_errors.append(error)
            return None
        if self.env.is_main:
            self.callbacks.on_checkpoint(self.view, self.step, str(path))
        self.result.checkpoint = str(path)
        self._saved_step = self.step
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Restore model, optimizer, scheduler, scaler, step, data position and RNG."""
        at = self.checkpointer.load(path)
        self.step, self.epoch, self.consumed = at.step, at.epoch, at.consumed
        self._saved_step = self.step
