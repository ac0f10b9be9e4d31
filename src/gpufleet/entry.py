"""Where a training run starts: the launching process, and each rank it starts.

``gpufleet train`` calls :func:`run_training` and :func:`gpufleet.fit` calls
:func:`start_ranks`: the config is resolved once into the run's plan
(:func:`gpufleet.plan.make_plan`), the run directory is locked and the ranks are started
(or this process trains, as the one rank). Every rank, however it was started, runs
:func:`run_rank`: the plan and the job in, the trained result out. See ARCHITECTURE.md
for the picture.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.config import Config
from gpufleet.core.callbacks import Callback
from gpufleet.errors import ConfigError, RunStopped
from gpufleet.fault.preempt import exit_status
from gpufleet.job import Job
from gpufleet.launch import DistEnv
from gpufleet.monitor.progress import Progress
from gpufleet.plan import RunPlan, make_plan

if TYPE_CHECKING:  # the training stack itself is imported by run_rank, on the ranks
    from gpufleet.train.engine.result import FitResult

log = logging.getLogger(__name__)


def stopped_message(signal_name: str, run_dir: str) -> str:
    """What a run stopped by a signal says: where it can continue from, and how."""
    from gpufleet.train.checkpoint.format import list_checkpoints

    found = list_checkpoints(run_dir)
    newest = f"the newest checkpoint is {found[-1]}" if found else "no checkpoint was written"
    return (f"stopped by {signal_name} after finishing the current step; {newest}. "
            f"Continue with the same command plus --resume latest (or --run-dir {run_dir} "
            "--resume latest).")


def run_training(cfg: Config, callbacks: Sequence[Callback] = ()) -> FitResult | None:
    """What ``gpufleet train`` runs: plan the config's job, train it here or in the ranks
    started now; returns rank 0's FitResult (None on the other ranks of a run that
    torchrun, SLURM or mpirun started, so that one summary is printed per job).

    Raises:
        RunStopped: a rank other than 0 of such a run was stopped by a signal (every
            rank then exits with the requeue status).
    """
    env = DistEnv.detect()
    plan = make_plan(cfg, env)  # the one resolve of this run
    result = start_ranks(plan, callbacks=callbacks)
    if plan.launcher != "external" or result is None:
        return result
    if result.preempted and not env.is_main:  # every rank exits "requeue"
        raise RunStopped(f"rank {env.rank} stopped by {result.preempted}.",
                         exit_status(getattr(signal, result.preempted)))
    return result if env.is_main else None  # one summary per job, from rank 0


def train(cfg: Config, callbacks: Sequence[Callback] = ()) -> FitResult:
    """Train the job a config names in this process, as the run's one rank (or as this
    rank of a run torchrun started), leaving this process's logging and process group
    as they are."""
    plan = make_plan(cfg, here=True)
    return start_ranks(plan, callbacks=callbacks, owns_process=False)


def start_ranks(plan: RunPlan, job: Job | None = None, callbacks: Sequence[Callback] = (),
                eval_metrics: Mapping[str, Any] | None = None, *,
                owns_process: bool = True) -> FitResult | None:
    """Train a planned run: here when this process is its rank (``plan.launcher`` none or
    external), else in the ranks started now on this node; returns this rank's result,
    or rank 0's (a node without rank 0: one of its own ranks').

    Args:
        plan: the run's plan.
        job: the model, data and loss (sent to every rank: picklable); None builds the
            job the config names on each rank.
        callbacks: extra callbacks for every rank (picklable when ranks are started).
        eval_metrics: ``{name: fn(output, target)}`` besides ``eval.metrics``.
        owns_process: gpufleet owns this process (the CLI): logging is set up here and
            a rank that trains here leaves its process group at the end. False inside
            the caller's process (:func:`gpufleet.fit`), whose setup stays.
    """
    if plan.launcher in ("none", "external"):  # this process is the rank
        return run_rank(plan, job, callbacks, eval_metrics, owns_process)
    return _launch_ranks(plan, job, list(callbacks), eval_metrics, owns_process)


def _launch_ranks(plan: RunPlan, job: Job | None, callbacks: list[Callback],
                  eval_metrics: Mapping[str, Any] | None, owns_process: bool
                  ) -> FitResult | None:
    """Check what the ranks are sent, lock the run directory, start the ranks (torch's
    elastic agent or spawn) and return rank 0's result."""
    from gpufleet.launch import launch
    from gpufleet.procs import forget_process, record_process
    from gpufleet.train.checkpoint import runlock
    from gpufleet.train.preflight import check_picklable, preflight_job

    cfg, dist = plan.cfg, plan.cfg.dist
    multi_node = plan.world_size > plan.nproc
    # Before any rank starts: what the ranks are sent, and one batch through the job.
    check_picklable(() if job is None else _sent(job, callbacks), plan.nproc)
    preflight_job(cfg, job)
    if multi_node and owns_process:
        setup_logging(cfg.log.level, DistEnv.detect())  # which interface and store host
    run_id_before, lock, made = os.environ.get(runlock.RUN_ID_ENV), None, []
    try:
        # Its run id goes to the ranks' env; ``made``: the folders this launch creates.
        cfg, lock, made = _plan_and_lock(cfg, multi_node)
        plan = plan.with_config(cfg)  # the directory chosen: nothing resolved again
        record_process(cfg.run.dir, "launcher")  # for `gpufleet cleanup RUN_DIR`
        results = launch(
            run_rank, (plan, job, callbacks, eval_metrics), nproc=plan.nproc,
            launcher=plan.launcher, nnodes=plan.nnodes, node_rank=plan.node_rank,
            master_addr=dist.master_addr, master_port=dist.master_port,
            rdzv_endpoint=dist.rdzv_endpoint, rdzv_backend=dist.rdzv_backend,
            rdzv_id=dist.rdzv_id or cfg.run.name, max_restarts=dist.max_restarts,
            rdzv_timeout=dist.rdzv_timeout, rdzv_last_call_s=dist.rdzv_last_call_s,
            rdzv_keep_alive_s=dist.rdzv_keep_alive_s, rdzv_poll_s=dist.rdzv_poll_s,
            grow_in_process=bool(cfg.fault.snapshot_every and cfg.fault.recover_in_process))
        forget_process(cfg.run.dir)
    except RunStopped as e:  # the agent got the signal: the ranks' results are lost
        raise RunStopped(stopped_message(e.signal, cfg.run.dir), e.exit_code, e.signal) from None
    except BaseException:
        if made:  # e.g. the ranks never met: leave nothing half-written
            forget_process(cfg.run.dir)
            if lock is not None:
                lock.release()
                lock = None
                _remove_start_files(Path(cfg.run.dir))
                runlock.remove_lock_file(cfg.run.dir)
            _remove_if_empty(made)
        raise
    finally:
        if lock is not None:
            lock.release()
        if run_id_before is None:  # this process may start other runs later
            os.environ.pop(runlock.RUN_ID_ENV, None)
        else:
            os.environ[runlock.RUN_ID_ENV] = run_id_before
    # On a node without global rank 0, a rank of this node says how the run ended.
    return results.get(0) or next((r for r in results.values() if r is not None), None)


def _sent(job: Job, callbacks: Sequence[Callback]) -> tuple:
    """What a rank is sent of ``job``, in :func:`check_picklable`'s order."""
    return (job.model, job.train_data, job.eval_data, job.loss_fn, callbacks,
            job.optimizer, job.scheduler, job.training_step)


def _plan_and_lock(cfg: Config, multi_node: bool) -> tuple[Config, Any, list[Path]]:
    """The launcher's run directory, locked for this run (see gpufleet.train.checkpoint.runlock),
    and the folders that did not exist before (a multi-node run's directory, which a
    launch whose ranks never met removes again)."""
    from gpufleet.procs import RECORDS_DIR
    from gpufleet.train.checkpoint import runlock
    from gpufleet.train.checkpoint.format import check_loadable, mark_verified
    from gpufleet.train.checkpoint.rundir import plan_and_lock

    dist = cfg.dist
    if multi_node:
        # Every node must agree on the run directory without talking to each other.
        if not cfg.run.dir:
            if not dist.rdzv_id:
                raise ConfigError(
                    "a multi-node run needs a run directory that every node agrees on. "
                    "Pass --rdzv-id NAME (the run writes to <out_dir>/<name>-NAME) or "
                    "--run-dir PATH, on a file system all nodes share.")
            run_dir = f"{cfg.run.out_dir}/{cfg.run.name}-{dist.rdzv_id}"
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=run_dir))
        # Every node of this run shares the lock: they agree on the rendezvous.
        where = dist.rdzv_endpoint or f"{dist.master_addr}:{dist.master_port}"
        os.environ[runlock.RUN_ID_ENV] = f"{dist.rdzv_id or cfg.run.name}@{where}"
        run_dir = Path(cfg.run.dir)
        made = [d for d in (run_dir / RECORDS_DIR, run_dir, *run_dir.parents)
                if not d.exists()]
        return cfg, runlock.acquire(run_dir), made
    os.environ[runlock.RUN_ID_ENV] = runlock.run_id()  # the ranks share the lock
    existed = bool(cfg.run.dir) and Path(cfg.run.dir).exists()
    cfg, resume_from, lock = plan_and_lock(cfg)  # one directory for every rank and restart
    try:
        if resume_from is not None:
            check_loadable(resume_from)  # refused here, once, not in a traceback per rank
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if resume_from is not None and resume_from.is_file():
        mark_verified(resume_from)  # checked just now: rank 0 need not hash it again
    run_dir = Path(cfg.run.dir)
    # A directory this start creates: one whose ranks fail before training leaves nothing.
    made = [run_dir / RECORDS_DIR, run_dir] if resume_from is None and not existed else []
    return cfg, lock, made


# What a start writes into a new run directory before training begins.
_START_FILES = frozenset({"config.toml", "run.lock", "procs", "transformers"})


def _remove_start_files(run_dir: Path) -> None:
    """Take out of a new run directory whose ranks failed (and ended) what their start
    wrote (config.toml, the model's record, this node's process records) when it holds
    nothing else: a log, a crash report or a checkpoint keeps the whole directory."""
    import socket

    from gpufleet.procs import RECORDS_DIR

    try:
        entries = {p.name for p in run_dir.iterdir()}
    except OSError:
        return
    if entries - _START_FILES:
        return
    (run_dir / "config.toml").unlink(missing_ok=True)
    for record in (run_dir / RECORDS_DIR).glob(f"{socket.gethostname()}-*.json"):
        record.unlink(missing_ok=True)
    record = run_dir / "transformers"
    if record.is_dir():
        (record / "config.json").unlink(missing_ok=True)
        _remove_if_empty([record])


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first
        try:
            folder.rmdir()  # only empty folders go
        except OSError:
            pass


def run_rank(plan: RunPlan, job: Job | None = None, callbacks: Sequence[Callback] = (),
             eval_metrics: Mapping[str, Any] | None = None,
             owns_process: bool = True) -> FitResult:
    """Train this process's rank of a planned run: the one entry point of every rank.

    Ranks that gpufleet starts (``gpufleet train --nproc N``, ``gpufleet.fit`` with
    ``dist.nproc > 1``) run it in their new process; a run of one rank runs it in the
    process that planned it; under torchrun, SLURM or mpirun each rank plans at its
    entry and runs it. In order, each once: logging is set up (``owns_process``), the
    process group joined, the job the config names built (when ``job`` is None: under
    the run's seed, so every rank builds the same weights), the run built from the plan
    (:func:`~gpufleet.train.engine.build.build_run`, which also seeds this rank), trained
    (:class:`~gpufleet.train.loop.Trainer`), and the process group left
    (``owns_process``).

    Args:
        plan: the run's plan (:func:`gpufleet.plan.make_plan`); not resolved again
            unless the rank's world differs from the planned one (an elastic node count).
        job: the model, data and loss; None builds the job the config names.
        callbacks: yours, after the run's own.
        eval_metrics: ``{name: fn(output, target)}`` besides ``eval.metrics``.
        owns_process: this process exists for this rank; False inside a caller's
            process (``gpufleet.fit``), whose logging and process group stay as they are.

    Returns:
        This rank's :class:`~gpufleet.train.loop.FitResult` (the same on every rank).
    """
    from gpufleet.launch import destroy_process_group
    from gpufleet.launch.grow import joining
    from gpufleet.train.engine.build import build_run
    from gpufleet.train.loop import Trainer
    from gpufleet.train.rank import join_process_group

    join = joining()
    if join is not None:  # started to join live ranks: its place among them, their run
        from gpufleet.config.loader import config_from_dict
        from gpufleet.launch.grow import live_run

        os.environ.update(RANK=str(join.rank), WORLD_SIZE=str(join.growth.world),
                          GROUP_RANK=str(join.node))
        settings, max_steps = live_run(join.growth, plan.cfg.dist.timeout)
        # It ends where they end: their world sized the epochs.
        settings["run"].update(max_steps=max_steps, max_epochs=0)
        plan = plan.with_config(config_from_dict(settings))
    env = DistEnv.detect()
    plan = plan.for_world(env)
    cfg = plan.cfg
    if owns_process:
        setup_logging(cfg.log.level, env)
    # First, so that the job can build its data with rank_zero_first. A rank that joins
    # live ones builds alone and meets them before its first step.
    if join is None:
        join_process_group(plan, env)
    try:
        if job is None:
            from gpufleet.job import build_job
            from gpufleet.train.seed import seeded

            with seeded(cfg.run.seed):  # the same initial weights on every rank
                job = build_job(cfg)
        elif owns_process:  # a job sent from the launching process: weights of its own
            own_weights(job.model)
        run = build_run(plan, job.model, job.train_data, job.eval_data, loss_fn=job.loss_fn,
                        callbacks=[Progress(cfg.log.progress), *callbacks],
                        eval_metrics=eval_metrics, optimizer=job.optimizer,
                        scheduler=job.scheduler, training_step=job.training_step)
        result = Trainer(run).fit()
    finally:
        if owns_process:
            destroy_process_group()
    if owns_process and result.preempted and "TORCHELASTIC_RUN_ID" in os.environ:
        _exit_unless_collected(result.preempted)
    return result


def own_weights(model: Any) -> None:
    """Give this rank private copies of ``model``'s tensors that arrived in shared memory.

    torch's multiprocessing sends tensors to the ranks it starts through shared memory:
    every rank's copy of the model would then be backed by the same storage, and each
    rank's optimizer step would land in all of them (with N ranks, N updates a step).
    The Parameter objects stay the same (an optimizer sent along still holds them); only
    their storage becomes this process's own.
    """
    import torch

    models = model.values() if isinstance(model, dict) else [model]
    with torch.no_grad():
        for tensor in [t for m in models for t in (*m.parameters(), *m.buffers())]:
            if tensor.is_shared():
                tensor.data = tensor.data.clone()


# Seconds a preempted rank waits for torch's elastic agent to collect its result.
COLLECT_GRACE_S = 5.0


def _exit_unless_collected(signal_name: str) -> None:
    """A rank of torch's elastic agent that stopped on a signal hands back its result and
    waits for the agent to read it. An agent that got the signal itself is shutting down
    and never reads it: the rank would sit there until the agent kills it 30 s later. So
    a daemon thread ends the process with the requeue status after a grace period
    (the checkpoint is written already); when the agent does read, the process ends
    first and the thread with it."""
    import signal
    import threading

    from gpufleet.fault.preempt import exit_status

    def leave() -> None:
        logging.shutdown()  # flush the log lines first: os._exit skips that
        os._exit(exit_status(getattr(signal, signal_name)))

    timer = threading.Timer(COLLECT_GRACE_S, leave)
    timer.daemon = True
    timer.start()


def setup_logging(level: str, env: Any) -> None:
    """Log lines with a rank prefix in multi-rank runs; ranks other than 0 show warnings
    and errors only, so a message meant once is printed once."""
    prefix = f"[rank {env.rank}] " if env.world_size > 1 else ""
    logging.basicConfig(format=f"{prefix}%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    logging.getLogger("gpufleet").setLevel(level if env.rank == 0 else "WARNING")


