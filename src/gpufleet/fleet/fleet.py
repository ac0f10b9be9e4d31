"""Your own training loop on gpufleet: :class:`Fleet`.

A Lightning Fabric or Accelerate loop moves over by changing a few lines: build a
``Fleet``, pass the model, optimizer and loaders through :meth:`Fleet.setup` and
:meth:`Fleet.setup_dataloaders`, call :meth:`Fleet.backward` instead of
``loss.backward()``. The loop stays yours; gpufleet's parts come with it:

* the run is planned once (:func:`gpufleet.plan.make_plan`: device, precision,
  strategy, backend, ranks) and each rank joins the process group the way every
  gpufleet rank does (:func:`gpufleet.train.rank.join_process_group`);
* the model is placed by :func:`gpufleet.parallel.parallelize.parallelize` and your
  optimizer rebuilt on the placed parameters by name (:mod:`gpufleet.train.recipe`);
* your loop's calls mark each step's phases on every rank (a loader's next batch:
  data; a forward: forward; ``backward``; ``optimizer.step``: optimizer), so the phase
  timer, watchdog, system sampler, metrics file and advisor work as in the built-in
  loop, and ``diagnosis.json`` and ``report.html`` are written at the end;
* a step whose loss or gradients are not finite is skipped on every rank, naming the
  rank and parameter (:class:`~gpufleet.train.nonfinite.NonFiniteGuard`);
* :meth:`Fleet.save` records the loaders' exact position, so a resumed loop reads the
  samples the uninterrupted one would have read.

Example:
    >>> fleet = Fleet(accelerator="cpu", devices=2, strategy="ddp")  # doctest: +SKIP
    >>> fleet.launch(train)  # train(fleet) on each of 2 ranks  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpufleet.config import Config, load_config, write_config
from gpufleet.core.callbacks import Callback, CallbackList
from gpufleet.core.phases import Phase, PhaseAnnouncer
from gpufleet.core.tree import to_device
from gpufleet.entry import setup_logging
from gpufleet.errors import ConfigError, unknown_choice
from gpufleet.fault.crash import crash_reported
from gpufleet.fleet.args import fleet_overrides
from gpufleet.fleet.loader import FleetLoader, shard_loader
from gpufleet.fleet.run import FleetRun
from gpufleet.fleet.state import load_state, save_state
from gpufleet.fleet.wrappers import FleetModule, hook_step
from gpufleet.launch import DistEnv, barrier, destroy_process_group, is_initialized, launch
from gpufleet.plan import RunPlan, make_plan
from gpufleet.procs import forget_process
from gpufleet.train.build import (
    _device,
    _monitors,
    _own_callbacks,
    _precision_and_strategy,
    _run_dir,
)
from gpufleet.train.interval import LogInterval
from gpufleet.train.nonfinite import NonFiniteGuard
from gpufleet.train.perf import share_cores
from gpufleet.train.rank import join_process_group
from gpufleet.train.recipe import spec_from_optimizer
from gpufleet.train.seed import seed_everything
from gpufleet.train.view import RunView

log = logging.getLogger(__name__)

# What Fleet sets in the config it plans: your loop owns the recipe and the signals.
_OWN_LOOP = {
    "optim.preset": "none", "optim.clip_norm": 0.0,  # clip_gradients is yours to call
    "fault.preempt_check_every": 0,  # SIGTERM / Ctrl-C reach your loop as usual
}


class Fleet:
    """Run your own training loop on one or many ranks with gpufleet underneath.

    Args:
        accelerator: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"gpu"``.
        devices: ranks per node (``"auto"``: one per visible GPU, 1 on a CPU).
        precision: ``"auto"``, ``"32-true"``/``"fp32"``, ``"bf16-mixed"``,
            ``"16-mixed"``/``"fp16-mixed"``.
        strategy: ``"auto"`` (ddp on several ranks, single on one), ``"single"``,
            ``"ddp"``, ``"fsdp"``, and gpufleet's other strategy names.
        num_nodes: nodes (the ranks of each are started there).
        seed: seeds python, numpy and torch on every rank (the same seed everywhere)
            and the loaders' shuffling (``run.seed``); None: your random state is left
            as it is and the loaders shuffle from ``run.seed``'s default.
        run_dir: the run directory (default: a new ``runs/<name>-<time>``).
        name: the run's name (default: the script's name).
        log_every: reduce the loss and phase times across ranks, log them and run the
            diagnosis every this many optimizer steps.
        overrides: more config keys, ``{"section.key": value}``.
        config: a whole :class:`~gpufleet.config.Config` to start from.
        callbacks: yours, heard after the run's own.

    Example:
        >>> fleet = Fleet(accelerator="cpu", devices=1)
        >>> fleet.world_size, fleet.global_rank, str(fleet.device)
        (1, 0, 'cpu')
        >>> fleet.finish()
    """

    def __init__(self, accelerator: str = "auto", devices: int | str = "auto",
                 precision: str | int = "auto", strategy: str = "auto", num_nodes: int = 1,
                 *, seed: int | None = None, run_dir: str | None = None,
                 name: str | None = None, log_every: int = 10,
                 overrides: dict[str, Any] | None = None, config: Config | None = None,
                 callbacks: Sequence[Callback] = ()) -> None:
        self._init_args = dict(accelerator=accelerator, devices=devices, precision=precision,
                               strategy=strategy, num_nodes=num_nodes, seed=seed,
                               run_dir=run_dir,
                               name=name, log_every=log_every, overrides=overrides,
                               config=config, callbacks=list(callbacks))
        keys: dict[str, Any] = {**_OWN_LOOP, "log.every": log_every,
                                **fleet_overrides(accelerator, devices, precision, strategy,
                                                  num_nodes)}
        if seed is not None:
            keys["run.seed"] = seed
        if run_dir:
            keys["run.dir"] = str(run_dir)
        if name:
            keys["run.name"] = name
        keys.update(overrides or {})
        cfg = load_config(overrides=keys, base=config)
        self.plan: RunPlan = make_plan(cfg)  # the one resolve of this run
        self._user_callbacks = list(callbacks)
        self._seed = seed
        self.run: FleetRun | None = None
        if self.plan.launcher in ("none", "external"):  # this process is a rank
            self._start_rank()

    # -- starting ---------------------------------------------------------------------
    def _start_rank(self) -> None:
        """Join the process group and build what the run needs on this rank, once."""
        env = DistEnv.detect()
        plan = self.plan.for_world(env)
        cfg = plan.cfg
        if not logging.getLogger().handlers:  # the caller's logging stays as it is
            setup_logging(cfg.log.level, env)
        self._owns_group = env.is_distributed and not is_initialized()
        join_process_group(plan, env)  # the way every gpufleet rank joins
        share_cores(env.local_world_size, env.is_main)
        if self._seed is not None:  # the same seed on every rank, as you asked
            seed_everything(self._seed)
        device = _device(cfg, env)
        precision, strategy = _precision_and_strategy(cfg, plan.dims, device)
        cfg, _, run_lock = _run_dir(cfg, env)  # COLLECTIVE: rank 0 chooses and locks it
        run_dir = Path(cfg.run.dir)
        self.plan = plan.with_config(cfg)
        self.run = FleetRun(cfg=cfg, env=env, device=device, run_dir=run_dir,
                            precision=precision, strategy=strategy, run_lock=run_lock,
                            monitors=_monitors(cfg, env, device, run_dir))
        self.run.result.run_dir = str(run_dir)
        self.run.view = RunView(self.run)
        self._announce: Callable[[Phase], None] = self._first_announce
        self._interval: LogInterval | None = None
        self._step_loss: torch.Tensor | None = None
        self._micro = 0
        self._prepared = False  # unscaled and inspected since the last step
        self._finished = False
        atexit.register(self._at_exit)

    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(fleet, *args)`` on every rank and return rank 0's result.

        When this process is a rank already (one device, torchrun, ``gpufleet run``),
        ``fn`` runs here. Otherwise the ranks are started now with torch's elastic agent
        (as ``gpufleet train --nproc N`` starts them): ``fn`` must then be a module-level
        function and ``args`` picklable. The run ends (:meth:`finish`) when ``fn``
        returns; an error leaves a crash report in the run directory.
        """
        if self.run is not None:
            return self._run_here(fn, args)
        plan, dist = self.plan, self.plan.cfg.dist
        results = launch(
            _rank_main, (self._init_args, fn, args), nproc=plan.nproc,
            launcher=plan.launcher, nnodes=plan.nnodes, node_rank=plan.node_rank,
            master_addr=dist.master_addr, master_port=dist.master_port,
            rdzv_endpoint=dist.rdzv_endpoint, rdzv_backend=dist.rdzv_backend,
            rdzv_id=dist.rdzv_id or plan.name, max_restarts=dist.max_restarts,
            rdzv_timeout=dist.rdzv_timeout)
        return results.get(0)

    def _run_here(self, fn: Callable[..., Any], args: tuple) -> Any:
        with crash_reported(self._rank_run().view):
            out = fn(self, *args)
            self.finish()
        return out

    def _rank_run(self) -> FleetRun:
        if self.run is None:
            raise ConfigError(
                f"this Fleet plans {self.plan.nproc} ranks and this process is not one of "
                "them yet. Put your loop in a function and call fleet.launch(fn), or start "
                "the script with `gpufleet run script.py --nproc N` or torchrun.")
        return self.run

    # -- facts ------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        """This rank's index in the job (0 before the ranks are started)."""
        return self.run.env.rank if self.run is not None else 0

    @property
    def local_rank(self) -> int:
        return self.run.env.local_rank if self.run is not None else 0

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.run.env.world_size if self.run is not None else self.plan.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self._rank_run().device

    @property
    def run_dir(self) -> Path:
        """Where the run writes metrics.jsonl, diagnosis.json and report.html."""
        return self._rank_run().run_dir

    @property
    def step(self) -> int:
        """Optimizer steps done (of the first optimizer set up)."""
        return self._rank_run().state.step

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on every rank for non-finite loss or gradients."""
        guard = self._rank_run().nonfinite
        return guard.skipped if guard is not None else 0

    @property
    def skip_records(self) -> list[Any]:
        """Each skipped step: its step, the ranks, the first bad parameter."""
        guard = self._rank_run().nonfinite
        return list(guard.records) if guard is not None else []

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    def seed_everything(self, seed: int) -> None:
        """Seed python, numpy and torch with ``seed`` on this rank."""
        seed_everything(seed)

    # -- setup ------------------------------------------------------------------------
    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer
              ) -> Any:
        """Place ``model`` as the run's strategy says and rebuild ``optimizers`` on the
        placed parameters (by parameter name: groups and settings kept, state not).
        COLLECTIVE (ddp broadcasts rank 0's weights).

        Returns:
            The model (a :class:`FleetModule`), or ``(model, *optimizers)``. Build an
            LR scheduler on the optimizer returned here.
        """
        run = self._rank_run()
        specs = [spec_from_optimizer(opt, model) for opt in optimizers]
        from gpufleet.parallel.parallelize import parallelize  # heavy: layer options

        placed = parallelize(model, run.strategy, run.cfg, run.env.world_size)
        wrapped = FleetModule(placed, run.strategy.unwrap(placed), self._phase_announce,
                              run.precision)
        built = [run.strategy.setup_optimizer(placed, spec) for spec in specs]
        for opt in built:
            primary = run.optimizer is None
            if primary:
                run.model, run.optimizer = placed, opt
                run.scheduler.optimizer = opt
                if run.cfg.fault.skip_nonfinite:
                    run.nonfinite = NonFiniteGuard(run.cfg.fault, run.strategy,
                                                   run.precision)
            hook_step(opt, self._primary_step if primary else self._other_step)
        return wrapped if not built else (wrapped, *built)

    def setup_module(self, model: nn.Module) -> FleetModule:
        """:meth:`setup` without an optimizer."""
        return self.setup(model)

    def setup_dataloaders(self, *loaders: Any, use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        """Each loader sharded over the ranks with a resumable sampler (its position is
        saved by :meth:`save`), its batches moved to this rank's device.

        A loader that shuffled is shuffled per epoch from the run's seed
        (``run.seed``), as torch's ``DistributedSampler(seed=...)`` would.

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
            mover = None
            if move_to_device and run.device.type != "cpu":
                device = run.device
                mover = lambda batch, d=device: to_device(batch, d, non_blocking=True)  # noqa: E731
            fleet_loader = FleetLoader(loader, sampler, self._on_batch, mover)
            run.data.loaders.append(fleet_loader)
            run.data.pin_memory = run.data.pin_memory or bool(loader.pin_memory)
            out.append(fleet_loader)
        return out[0] if len(out) == 1 else tuple(out)

    # -- the step ---------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the run: the backward phase, the precision's loss
        scaling, and the loss kept for the log line and the non-finite guard."""
        run = self._rank_run()
        self._announce(Phase.BACKWARD)
        run.precision.backward(loss)
        detached = loss.detach()
        self._step_loss = detached if self._step_loss is None else self._step_loss + detached
        self._micro += 1

    @contextlib.contextmanager
    def no_backward_sync(self, model: nn.Module, enabled: bool = True) -> Iterator[None]:
        """Backward passes inside do not synchronise gradients across ranks (ddp's
        ``no_sync``): for gradient accumulation, all but the last micro-batch."""
        placed = model.placed if isinstance(model, FleetModule) else model
        with self._rank_run().strategy.no_sync(placed) if enabled \
                else contextlib.nullcontext():
            yield

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                       max_norm: float | None = None, clip_val: float | None = None
                       ) -> torch.Tensor | None:
        """Clip by value and/or by global norm (unscaled first; the non-finite guard
        looks at the gradients before they are clipped). Returns the norm before
        clipping (a device tensor) when clipping by norm."""
        if max_norm is None and clip_val is None:
            raise ConfigError("clip_gradients needs max_norm=... or clip_val=...")
        run = self._rank_run()
        self._announce(Phase.OPTIMIZER)
        placed = model.placed if isinstance(model, FleetModule) else model
        if optimizer is run.optimizer:
            self._prepare_step(optimizer)
        else:
            run.precision.unscale(optimizer)
        if clip_val is not None:
            torch.nn.utils.clip_grad_value_(placed.parameters(), clip_val)
        if max_norm is None:
            return None
        norm = run.strategy.clip_grad_norm(placed, max_norm)  # COLLECTIVE with sharding
        if optimizer is run.optimizer and self._interval is not None:
            self._interval.grad_norm = norm
            if not run.cfg.optim.clip_norm:  # the log line shows the norm from now on
                run.cfg = dataclasses.replace(run.cfg, optim=dataclasses.replace(
                    run.cfg.optim, clip_norm=float(max_norm)))
        return norm

    def _prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per step, before clipping or stepping: unscale, then let the guard see
        the gradients as backward left them."""
        if self._prepared:
            return
        run = self._rank_run()
        run.precision.unscale(optimizer)
        guard = run.nonfinite
        if guard is not None and (guard.on_device is None or guard.inspects):
            guard.inspect(run.model, self._loss_or_zero(), optimizer)
        self._prepared = True

    def _loss_or_zero(self) -> torch.Tensor:
        if self._step_loss is None:
            return torch.zeros((), device=self._rank_run().device)
        return self._step_loss

    def _primary_step(self, optimizer: torch.optim.Optimizer, original: Any,
                      closure: Any) -> Any:
        """The first optimizer's step: the guard, the step, then the step's end."""
        run = self._rank_run()
        self._announce(Phase.OPTIMIZER)
        self._prepare_step(optimizer)
        step_loss, guard, out = self._loss_or_zero(), run.nonfinite, None
        # COLLECTIVE (+ SYNC off the device path): every rank agrees on skipping.
        skip = guard is not None and guard.should_skip(run.model, step_loss, None, optimizer)
        if not skip:
            out = (original(closure) if closure is not None else
                   run.precision.step(optimizer))  # SYNC with fp16 (found_inf)
            if self._micro:
                self._interval.add(step_loss, self._micro)
        run.strategy.after_optimizer_step(run.model, run.state.step)
        run.state.step += 1
        self._step_loss, self._micro, self._prepared = None, 0, False
        if skip:
            guard.report(run.state.step, run.env.is_main)  # stops after too many in a row
        self._end_step()
        return out

    def _other_step(self, optimizer: torch.optim.Optimizer, original: Any,
                    closure: Any) -> Any:
        """Another optimizer's step (a GAN's second one): unscaled, then stepped."""
        run = self._rank_run()
        self._announce(Phase.OPTIMIZER)
        run.precision.unscale(optimizer)
        return original(closure) if closure is not None else run.precision.step(optimizer)

    def _end_step(self) -> None:
        run = self._rank_run()
        self._announce(Phase.END)
        run.callbacks.on_step_end(run.view, run.state.step)
        if run.state.step % run.cfg.log.every == 0:
            self._log()

    def _log(self) -> None:
        """The log interval's one all-reduce (COLLECTIVE + SYNC), then the callbacks."""
        run = self._rank_run()
        run.phases.announce(Phase.LOG)
        metrics = self._interval.close()
        run.result.losses.append((run.state.step, metrics["loss"]))
        run.callbacks.on_log(run.view, run.state.step, metrics)

    # -- phases -----------------------------------------------------------------------
    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """``with fleet.phase("data"): ...`` marks a part of your step yourself (data,
        forward, backward, optimizer, eval, checkpoint); your loop's calls mark them
        without it."""
        try:
            phase = Phase(name)
        except ValueError:
            raise ConfigError(unknown_choice("phase", name, [p.value for p in Phase])) from None
        return _Marked(self._phase_announce, phase)

    def _phase_announce(self, phase: Phase) -> None:
        self._announce(phase)

    def _on_batch(self) -> None:
        """A loader is asked for its next batch: the data phase (inside evaluation,
        still evaluation)."""
        if self._rank_run().phases.current != Phase.EVAL:
            self._announce(Phase.DATA)

    def _first_announce(self, phase: Phase) -> None:
        """The loop's first step begins: build the monitors, then announce as usual."""
        self._begin()
        self._announce(phase)

    def _begin(self) -> None:
        """The run's own callbacks (phase timer, watchdog, system sampler, metrics file,
        advisor, as the built-in loop has them), told the loop has started."""
        run = self._rank_run()
        first = run.data.loaders[0].loader if run.data.loaders else None
        if first is not None:  # the diagnosis reads the batch and worker settings
            run.cfg = dataclasses.replace(run.cfg, data=dataclasses.replace(
                run.cfg.data, batch_size=first.batch_size or run.cfg.data.batch_size,
                num_workers=first.num_workers))
            if run.env.is_main:
                write_config(run.cfg, run.run_dir / "config.toml")
        run.callbacks = CallbackList(_own_callbacks(run) + self._user_callbacks)
        if run.monitors.system_sampler is None:
            from gpufleet.monitor.system import SystemSampler

            run.monitors.system_sampler = next(
                (cb for cb in self._user_callbacks if isinstance(cb, SystemSampler)), None)
        run.phases = PhaseAnnouncer(run.callbacks.phase_listeners, run.view)
        self._announce = run.phases.announce
        self._interval = LogInterval(run)
        run.callbacks.on_fit_start(run.view)

    # -- collectives ------------------------------------------------------------------
    def all_reduce(self, value: Any, reduce_op: str = "mean") -> Any:
        """``value`` (a tensor or a number) reduced over every rank: ``"mean"``,
        ``"sum"``, ``"max"`` or ``"min"``. COLLECTIVE; a number comes back as a float
        (SYNC)."""
        run = self._rank_run()
        ops = ("mean", "sum", "max", "min")
        if reduce_op not in ops:
            raise ConfigError(unknown_choice("reduce_op", reduce_op, ops))
        number = not isinstance(value, torch.Tensor)
        tensor = torch.tensor(float(value), device=run.device) if number \
            else value.detach().clone()
        run.strategy.all_reduce(tensor, "sum" if reduce_op == "mean" else reduce_op)
        if reduce_op == "mean":
            tensor = tensor / run.env.world_size
        return float(tensor) if number else tensor

    def barrier(self) -> None:
        """Wait until every rank is here (COLLECTIVE)."""
        self._rank_run()
        barrier()

    # -- checkpoints ------------------------------------------------------------------
    def save(self, path: str | Path, state: dict[str, Any]) -> Path:
        """Save ``state`` (models, optimizers, schedulers, set-up loaders, plain values)
        to ``path``: rank 0 writes it atomically with a checksum, with every rank's RNG
        states and each loader's exact position. COLLECTIVE: call it on every rank."""
        run = self._rank_run()
        with run.phases(Phase.CHECKPOINT):
            return save_state(path, state, run.strategy, run.env.rank)

    def load(self, path: str | Path, state: dict[str, Any]) -> dict[str, Any]:
        """Restore what :meth:`save` wrote into ``state`` (in place: objects load their
        state dicts, plain values are replaced), read with ``weights_only=True``.
        Returns what the file holds beyond ``state``'s keys."""
        run = self._rank_run()
        return load_state(path, state, run.strategy, run.env.rank, run.env.world_size)

    # -- the end ----------------------------------------------------------------------
    def finish(self) -> None:
        """End the run: the last log interval (COLLECTIVE), diagnosis.json, report.html,
        the watchdog stopped, the run directory unlocked and the process group left (if
        Fleet joined it). :meth:`launch` calls it; call it at the end of a loop that
        runs without ``launch``."""
        self._end(collective=True)

    def _at_exit(self) -> None:
        """At interpreter exit, a loop that never called :meth:`finish` still gets its
        diagnosis and report (without the last partial log interval: no collective)."""
        with contextlib.suppress(Exception):
            self._end(collective=False)

    def _end(self, collective: bool) -> None:
        run = self.run
        if run is None or self._finished:
            return
        self._finished = True
        atexit.unregister(self._at_exit)
        try:
            if self._interval is not None:
                if collective and run.state.step % run.cfg.log.every:
                    self._log()  # the steps since the last log line
                result = run.result
                result.steps = run.state.step
                result.skipped_steps = self.skipped_steps
                result.train_time_s = run.state.train_time_s
                if run.state.train_time_s > 0:
                    result.samples_per_s = run.state.samples / run.state.train_time_s
                run.callbacks.on_fit_end(run.view, result)
                if run.env.is_main and run.cfg.monitor.report:
                    _write_report(run.run_dir)
            forget_process(run.run_dir)
        finally:
            run.close()
            if collective and getattr(self, "_owns_group", False):
                destroy_process_group()


class _Marked:
    """``with fleet.phase(...)``: announces the phase on entry."""

    def __init__(self, announce: Callable[[Phase], None], phase: Phase) -> None:
        self._announce, self._phase = announce, phase

    def __enter__(self) -> None:
        self._announce(self._phase)

    def __exit__(self, *exc: object) -> None:
        return None


def _rank_main(init_args: dict[str, Any], fn: Callable[..., Any], args: tuple) -> Any:
    """What each started rank runs: its own Fleet, then ``fn(fleet, *args)``."""
    fleet = Fleet(**init_args)
    return fleet._run_here(fn, args)


def _write_report(run_dir: Path) -> None:
    """report.html for the run (not essential: a failure is reported, not raised)."""
    from gpufleet.monitor.report import write_report

    try:
        write_report(run_dir)
    except Exception as e:
        log.error("the HTML report could not be written: %s: %s", type(e).__name__, e)
