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
  rank and parameter (:class:`~gpufleet.train.guard.nonfinite.NonFiniteGuard`);
* :meth:`Fleet.save` records the loaders' exact position, so a resumed loop reads the
  samples the uninterrupted one would have read.

Example:
    >>> fleet = Fleet(accelerator="cpu", devices=2, strategy="ddp")  # doctest: +SKIP
    >>> fleet.launch(train)  # train(fleet) on each of 2 ranks  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gpufleet.config import Config, load_config
from gpufleet.core.callbacks import Callback
from gpufleet.core.phases import Phase, PhaseScope
from gpufleet.core.tree import to_device
from gpufleet.errors import ConfigError, unknown_choice
from gpufleet.fleet.accumulate import Accumulation
from gpufleet.fleet.args import FABRIC_FP16, fleet_overrides
from gpufleet.fleet.comm import FleetComm
from gpufleet.fleet.dtypes import ForwardDtypes
from gpufleet.fleet.grads import FleetGrads, check_backward_inputs
from gpufleet.fleet.init import FleetInit
from gpufleet.fleet.launching import FleetLaunch
from gpufleet.fleet.loader import SetUpLoaders
from gpufleet.fleet.logs import FleetLogs, as_list, as_loggers
from gpufleet.fleet.preemption import FleetPreemption
from gpufleet.fleet.recovery import FleetRecovery, RecoveryGuard
from gpufleet.fleet.schedule import FleetSchedule
from gpufleet.fleet.seeding import seed_everything
from gpufleet.fleet.setup import FleetSetup
from gpufleet.fleet.state import FleetCheckpoints
from gpufleet.fleet.steps import StepTracker
from gpufleet.fleet.strategy import FleetStrategy
from gpufleet.fleet.wrappers import FleetModule
from gpufleet.launch import DistEnv, destroy_process_group, is_initialized
from gpufleet.parallel import strategy_class
from gpufleet.plan import RunPlan, make_plan
from gpufleet.resolve import Machine
from gpufleet.train.engine.build import build_own_loop_run
from gpufleet.train.engine.result import FitResult
from gpufleet.train.engine.run import Run
from gpufleet.train.perf import share_cores
from gpufleet.train.rank import join_process_group
from gpufleet.train.seed import seed_everything as seed_all

log = logging.getLogger(__name__)

# What Fleet sets in the config it plans: your loop owns the recipe and the signals.
_OWN_LOOP = {
    "optim.preset": "none", "optim.clip_norm": 0.0,  # clip_gradients is yours to call
    "fault.snapshot_every": 0,  # gpufleet's own loop takes in-memory snapshots; yours not
}


def rank_main(init_args: dict[str, Any], fn: Callable[..., Any] | None, args: tuple,
              kwargs: dict[str, Any] | None = None, cls: type[Fleet] | None = None) -> Any:
    """What each started rank runs: its own Fleet (of ``cls``, a subclass, when given),
    then ``fn(fleet, *args)``, or without ``fn`` the subclass's own ``run(*args)``."""
    fleet = (cls or Fleet)(**init_args)
    if fn is None:
        own_run = cast(Callable[..., Any], fleet.run)  # the subclass's run(), launched
        return own_run(*args, **(kwargs or {}))
    return fleet._run_here(fn, args, kwargs)


class Fleet(FleetLaunch, FleetSetup, FleetInit, FleetComm, FleetGrads, FleetCheckpoints,
            FleetLogs, FleetPreemption, FleetSchedule, FleetRecovery):
    """Run your own training loop on one or many ranks with gpufleet underneath.

    Args:
        accelerator: ``"auto"`` (the default), ``"cpu"``, ``"cuda"`` or ``"gpu"``.
        devices: ranks per node (``"auto"``: one per visible GPU, 1 on a CPU).
        precision: ``"32-true"``/``"fp32"`` (the default, as Fabric's: your loop's
            numbers as plain PyTorch gives them; the diagnosis says when bf16 would pay),
            ``"bf16-mixed"``, ``"16-mixed"``/``"fp16-mixed"``, or ``"auto"`` (your
            loop's own recipe: fp32 too; TF32 is left as torch or your script set it).
        strategy: ``"auto"`` (the default: ddp on several ranks, single on one),
            ``"single"``, ``"ddp"``, ``"fsdp"``, and gpufleet's other strategy names
            (``"pipeline"``: train through :meth:`forward_backward`;
            ``"model_parallel"``: with ``parallel.device_map`` in ``overrides``).
            With ``config``, an ``accelerator``, ``precision`` or ``strategy`` left out
            keeps the config's own.
        num_nodes: nodes (the ranks of each are started there).
        seed: seeds python, numpy and torch on every rank (the same seed everywhere)
            and, on several ranks, the loaders' shuffling (``run.seed``); None: your
            random state is left as it is and the loaders of several ranks shuffle
            from ``run.seed``'s default. In one process a loader shuffles as its own
            ``RandomSampler`` would, from torch's random state.
        run_dir: the run directory (default: a new ``runs/<name>-<time>``).
        name: the run's name (default: the script's name, else ``fleet``).
        log_every: reduce the loss and phase times across ranks, log them and run the
            diagnosis every this many optimizer steps.
        overrides: more config keys, ``{"section.key": value}``.
        config: a whole :class:`~gpufleet.config.Config` to start from.
        callbacks: yours (one, or a list): the :class:`~gpufleet.core.callbacks.Callback`
            objects among them hear gpufleet's hooks after the run's own; every one,
            any object, is reached by :meth:`call` (Fabric's callbacks).
        loggers: Fabric's loggers (a logger or a list: objects with
            ``log_metrics(metrics, step)``, such as Lightning's), handed what
            :meth:`log_dict` logs on rank 0, beside ``metrics.jsonl``.
        gradient_accumulation_steps: Accelerate's: micro-batches per optimizer step
            under :meth:`accumulate` (see :mod:`~gpufleet.fleet.accumulate`); above 1,
            :meth:`backward` divides the loss by it.
        resume: ``"auto"`` (the newest checkpoint of the run directory, or of the
            newest run of this name, if there is one), ``"latest"`` (it must exist) or
            a checkpoint's path: :attr:`resume_from`, for your ``fleet.load`` (a
            preempted run goes on: see :mod:`~gpufleet.fleet.preemption`). None: a
            fresh start (a run directory holding checkpoints is then refused).

    Example:
        >>> fleet = Fleet(accelerator="cpu", devices=1)  # doctest: +SKIP
        >>> model, optimizer = fleet.setup(model, optimizer)  # doctest: +SKIP
        >>> loader = fleet.setup_dataloaders(loader)  # doctest: +SKIP
    """

    _rank_entry = staticmethod(rank_main)

    def __init__(self, accelerator: str | None = None, devices: int | str = "auto",
                 precision: str | int | None = None, strategy: str | None = None,
                 num_nodes: int = 1,
                 *, seed: int | None = None, run_dir: str | None = None,
                 name: str | None = None, log_every: int = 10,
                 overrides: dict[str, Any] | None = None, config: Config | None = None,
                 callbacks: Sequence[Any] = (), loggers: Any = None,
                 gradient_accumulation_steps: int = 1, resume: str | None = None) -> None:
        self._own_run()  # a subclass's own run(): launched when called, as Fabric's
        self._init_args = dict(accelerator=accelerator, devices=devices, precision=precision,
                               strategy=strategy, num_nodes=num_nodes, seed=seed,
                               run_dir=run_dir,
                               name=name, log_every=log_every, overrides=overrides,
                               config=config, callbacks=as_list(callbacks), loggers=loggers,
                               gradient_accumulation_steps=gradient_accumulation_steps,
                               resume=resume)
        machine = Machine.detect()
        keys: dict[str, Any] = {**_OWN_LOOP, "log.every": log_every,
                                **fleet_overrides(accelerator, devices, precision, strategy,
                                                  num_nodes, defaults=config is None,
                                                  cuda=machine.cuda)}
        if str(precision) in FABRIC_FP16 and keys["precision.mode"] == "bf16-mixed" and \
                DistEnv.detect().rank == 0:  # (on the first rank only, as Fabric says it)
            warnings.warn(
                f"Fleet(precision={precision!r}) on a CPU: fp16 mixed precision is CUDA's, "
                "so this run uses 'bf16-mixed' instead, as Lightning Fabric does. Ask for "
                "precision='bf16-mixed' to say so, or '32-true'.", UserWarning, stacklevel=2)
        agent_restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
        if agent_restarts is not None:  # a rank of torch's elastic agent (gpufleet run,
            keys["dist.max_restarts"] = int(agent_restarts)  # torchrun): as it was given
        if seed is not None:
            keys["run.seed"] = seed
        if run_dir:
            keys["run.dir"] = str(run_dir)
        if resume is not None:
            keys["checkpoint.resume"] = resume
        if name or config is None or not config.run.name:
            keys["run.name"] = name or _script_name()
        keys.update(overrides or {})
        cfg = load_config(overrides=keys, base=config)
        self.plan: RunPlan = make_plan(cfg, own_loop=True,  # the one resolve of this run
                                       machine=machine)
        self._user_callbacks = as_list(callbacks)
        self._loggers = as_loggers(loggers)
        self._seed = seed
        self._fleet_run: Run | None = None  # this rank's run (``run``, once a rank)
        self._loaders = SetUpLoaders()  # the loaders your loop sets up
        self._strategy_view = FleetStrategy(self)
        self._placed: list[nn.Module] = []  # every model set up, as placed
        self._modules: list[FleetModule] = []  # and as your loop holds it
        self._dtypes = ForwardDtypes()  # what a set-up model's forward converts
        self._accumulation = Accumulation(gradient_accumulation_steps)
        if self.plan.launcher in ("none", "external"):  # this process is a rank
            self._start_rank()

    # -- starting ---------------------------------------------------------------------
    def _start_rank(self) -> None:
        """Join the process group and build what the run needs on this rank, once."""
        env = DistEnv.detect()
        plan = self.plan.for_world(env)
        cfg = plan.cfg
        log_until_configured(cfg.log.level, env)  # the caller's logging stays theirs
        self._owns_group = env.is_distributed and not is_initialized()
        join_process_group(plan, env)  # the way every gpufleet rank joins
        if not is_initialized() and strategy_class(cfg.parallel.strategy).needs_process_group:
            # One process asked for ddp (or another strategy of several ranks): as
            # Fabric does, it joins a process group of its own, of one rank.
            dist.init_process_group(plan.backend, store=dist.HashStore(), rank=0,
                                    world_size=1)
            self._owns_group = True
        share_cores(env.local_world_size, env.is_main)
        if self._seed is not None:  # the same seed on every rank, as you asked
            seed_all(self._seed)
        # COLLECTIVE: device, precision, strategy, the run directory (rank 0 chooses and
        # locks it) and the monitors, by the steps build_run takes for gpufleet's loop
        run = self._fleet_run = build_own_loop_run(plan, env, self._loaders)
        given = self._init_args["precision"]
        self._dtypes = ForwardDtypes.for_run(given, run.precision.autocast_dtype)
        self.plan = plan.with_config(run.cfg)
        # gpufleet's hooks reach its own Callback objects; call() reaches every one
        self._steps = StepTracker(run, self._loaders,
                                  [cb for cb in self._user_callbacks
                                   if isinstance(cb, Callback)],
                                  on_preempted=self._stop_for_preemption)
        # Every call that runs a collective runs in it: a lost node met there is
        # recovered in process (with snapshots of a registered state)
        self._guard = self._steps.guard = RecoveryGuard(run, self._steps.went_on)
        atexit.register(self._at_exit)

    # -- facts ------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        """This rank's index in the job (0 before the ranks are started)."""
        return self._fleet_run.env.rank if self._fleet_run is not None else 0

    @property
    def local_rank(self) -> int:
        return self._fleet_run.env.local_rank if self._fleet_run is not None else 0

    @property
    def node_rank(self) -> int:
        """This node's index (0 before the ranks are started)."""
        return self._fleet_run.env.node_rank if self._fleet_run is not None else 0

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        run = self._fleet_run
        return run.env.world_size if run is not None else self.plan.world_size

    @property
    def strategy(self) -> FleetStrategy:
        """Fabric's ``fabric.strategy`` as far as a loop reads it: this rank's facts
        (``root_device``, ``world_size``...) and the collectives (``barrier``,
        ``reduce_boolean_decision``...), not Lightning's Strategy object (see
        :mod:`gpufleet.fleet.strategy`)."""
        return self._strategy_view

    @property
    def result(self) -> FitResult:
        """The run's totals (``fleet.run.result``), filled in by :meth:`finish`."""
        return self._rank_run().result

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
        """Optimizer steps done (of the first optimizer set up); :meth:`load` of a
        checkpoint :meth:`save` wrote restores it, so a resumed loop counts on."""
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

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None,
                        verbose: bool = True) -> int:
        """Seed python, numpy and torch in this process and return the seed, as
        Fabric's (:func:`gpufleet.fleet.seeding.seed_everything`: None reads
        ``PL_GLOBAL_SEED``, else 0; bounds checked; ``PL_GLOBAL_SEED`` set).
        ``workers`` (None: True, Fabric's default): the loaders set up afterwards seed
        their workers from the rank too (see :mod:`~gpufleet.fleet.seeding`), and on
        several ranks shuffle from this seed, as Fabric's ``DistributedSampler`` does."""
        return seed_everything(seed, workers=workers is None or bool(workers),
                               verbose=verbose)

    # -- the step ---------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, retain_graph: bool | None = None,
                 inputs: Any = None, create_graph: bool = False,
                 model: nn.Module | None = None) -> None:
        """``loss.backward(retain_graph=, inputs=, create_graph=)`` through the run: the
        backward phase, the precision's loss scaling, and the loss kept for the log
        line and the non-finite guard. ``model`` is taken as Fabric takes it, and not
        needed."""
        self._rank_run()
        if inputs is not None:
            check_backward_inputs(inputs)
        every = self._accumulation.every
        if every > 1:  # as Accelerate's backward: the mean over the micro-batches
            loss = loss / every
        with self._guard:  # COLLECTIVE (ddp: the gradients' all-reduce)
            self._steps.backward(loss, retain_graph=retain_graph, inputs=inputs,
                                 create_graph=create_graph)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-batch of Accelerate's gradient accumulation
        (``Fleet(gradient_accumulation_steps=N)``): every N-th block, and the block of
        a set-up loader's last batch, synchronises the gradients and lets the set-up
        optimizers' ``step`` and ``zero_grad`` act; the others skip the all-reduce
        (``no_backward_sync``) and make ``step`` and ``zero_grad`` do nothing. See
        :mod:`gpufleet.fleet.accumulate`."""
        self._rank_run()
        read = self._loaders.read_last()
        last = read.at_last_batch if read is not None else False
        sync = self._accumulation.begin(last_batch=last)
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in models:
                    stack.enter_context(self.no_backward_sync(model))
            yield

    @property
    def sync_gradients(self) -> bool:
        """Whether the :meth:`accumulate` block under way (or the last one) synchronises
        and steps: Accelerate's ``accelerator.sync_gradients``. True outside any."""
        return self._accumulation.sync

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The context a set-up model's forward runs in, for what your loop computes
        outside it (a loss on its outputs), as Fabric's: the run's autocast
        (bf16-mixed, fp16-mixed), or a true precision's default dtype (bf16-true,
        16-true, 64-true); nothing under fp32."""
        with self._rank_run().precision.autocast(), self._dtypes.default_dtype():
            yield

    def to_device(self, obj: Any) -> Any:
        """``obj`` (a tensor, a module, or a dict, list or tuple of tensors) on this
        rank's device."""
        device = self._rank_run().device
        return obj.to(device) if isinstance(obj, nn.Module) else to_device(obj, device)

    # -- phases -----------------------------------------------------------------------
    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """``with fleet.phase("data"): ...`` marks a part of your step yourself (data,
        forward, backward, optimizer, eval, checkpoint); your loop's calls mark them
        without it."""
        try:
            phase = Phase(name)
        except ValueError:
            raise ConfigError(unknown_choice("phase", name, [p.value for p in Phase])) from None
        return PhaseScope(self._steps.phase_announce, phase)

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
        if self._fleet_run is None or self._steps.finished:
            return
        atexit.unregister(self._at_exit)
        try:
            self._wait_for_saves(collective)  # a background save finishes first
            self._steps.end(collective)
        finally:
            if collective and self._owns_group:
                destroy_process_group()
        self._pass_on_signal()  # a stop signal no step boundary came to act on

class _UntilConfigured(logging.StreamHandler):
    """Prints gpufleet's lines while the root logger has no handler (the script has not
    configured logging); once it has one, the lines go to the script's handlers only
    (they propagate), so nothing prints twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def log_until_configured(level: str, env: DistEnv) -> None:
    """gpufleet's log lines on stderr (with a rank prefix on several ranks; ranks other
    than 0 show warnings and errors only), through a handler on the ``gpufleet`` logger,
    not the root: a ``logging.basicConfig(level=...)`` the script calls afterwards still
    configures the root logger, and its own lines show as it asks."""
    logger = logging.getLogger("gpufleet")
    logger.setLevel(level if env.rank == 0 else "WARNING")
    if any(isinstance(h, _UntilConfigured) for h in logger.handlers):
        return
    prefix = f"[rank {env.rank}] " if env.world_size > 1 else ""
    handler = _UntilConfigured()
    handler.setFormatter(logging.Formatter(
        f"{prefix}%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logger.addHandler(handler)


def _script_name() -> str:
    """The running script's name (``train`` for ``train.py``), or ``fleet``."""
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    return script if script and script not in ("-c", "__main__") else "fleet"
