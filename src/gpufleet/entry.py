"""Where a training run starts: the launching process, and each rank it starts.

``gpufleet train`` and :func:`gpufleet.fit` call :func:`run_training`: it resolves the
config once, locks the run directory and starts the ranks (or trains here, with one
process); each launched rank runs :func:`run_worker`, which builds the job the config
names and trains it (:mod:`gpufleet.train.loop`). See ARCHITECTURE.md for the picture.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufleet.config import Config, config_from_dict, config_to_dict
from gpufleet.core.callbacks import Callback
from gpufleet.errors import ConfigError, RunStopped
from gpufleet.fault.preempt import exit_status
from gpufleet.train.build import build_run
from gpufleet.train.loop import FitResult, Trainer
from gpufleet.train.seed import seed_everything

log = logging.getLogger(__name__)


def stopped_message(signal_name: str, run_dir: str) -> str:
    """What a run stopped by a signal says: where it can continue from, and how."""
    from gpufleet.train.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    newest = f"the newest checkpoint is {found[-1]}" if found else "no checkpoint was written"
    return (f"stopped by {signal_name} after finishing the current step; {newest}. "
            f"Continue with the same command plus --resume latest (or --run-dir {run_dir} "
            "--resume latest).")


def run_training(cfg: Config, worker: Any = None, extra: tuple = (), job: Any = None) -> Any:
    """Train here, or start the ranks and train there; returns rank 0's FitResult.

    Args:
        cfg: the run's config.
        worker: what each rank runs, ``worker(cfg_dict, *extra)`` (default: the job the
            config names, :func:`run_worker`).
        extra: further arguments for ``worker``, sent to every rank (picklable).
        job: the model, data and loss the preflight checks (a
            :class:`gpufleet.job.Job`); None builds the job the config names.
    """
    from gpufleet.launch import DistEnv, launch
    from gpufleet.launch.env import launched_layout
    from gpufleet.procs import forget_process, record_process
    from gpufleet.resolve import Machine, resolve
    from gpufleet.train import runlock
    from gpufleet.train.preflight import check_picklable, preflight_job
    from gpufleet.train.rundir import named

    worker = worker or run_worker
    cfg = named(cfg)  # e.g. gpt-stdlib: every rank and node then agrees on it
    env = DistEnv.detect()
    if env.is_distributed:  # torchrun, SLURM, horovodrun, mpirun or our launcher
        if env.source == "slurm":  # config.toml records the layout srun started
            cfg = dataclasses.replace(cfg, dist=dataclasses.replace(
                cfg.dist, **launched_layout(env)))
        result = worker(config_to_dict(cfg), *extra)
        if result.preempted and not env.is_main:  # every rank exits "requeue"
            raise RunStopped(f"rank {env.rank} stopped by {result.preempted}.",
                             exit_status(getattr(signal, result.preempted)))
        return result if env.is_main else None  # one summary per job, from rank 0
    dist = cfg.dist
    traits = strategy_traits(cfg)
    if traits.ranks_started_elsewhere and dist.nproc > 1:
        name = cfg.parallel.strategy
        raise ConfigError(
            f"--nproc {dist.nproc} with --strategy {name}: its ranks are started by "
            f"horovodrun, not by gpufleet. Run: horovodrun -np {dist.nproc} gpufleet train "
            f"--strategy {name} ... (without --nproc).")
    nproc = dist.nproc or _visible_gpus(cfg)
    max_nodes = int(dist.nnodes.split(":")[-1])
    multi_node = max_nodes > 1
    launcher = dist.launcher
    if launcher == "slurm":
        raise ConfigError("dist.launcher = 'slurm' records that srun started the ranks of "
                          "the run this config comes from, but this process is not a rank "
                          "of an srun step. Run it under srun, or pass --launcher auto.")
    if launcher == "auto":
        needs_agent = nproc > 1 or multi_node or dist.max_restarts > 0
        launcher = "elastic" if needs_agent else "none"
    if launcher == "none" and (nproc > 1 or multi_node):
        raise ConfigError(f"dist.launcher = 'none' runs one process, but {nproc} rank(s) "
                          f"on {dist.nnodes} node(s) were asked for. Use "
                          "--launcher elastic (or spawn), or --nproc 1.")
    cfg = dataclasses.replace(cfg, dist=dataclasses.replace(dist, nproc=nproc,
                                                            launcher=launcher))
    if launcher == "none":  # this process is the one rank: it resolves the config itself
        return worker(config_to_dict(cfg), *extra)  # rank 0 locks the run directory
    # Check the whole config here, once, before any rank starts: a mistake then reads as
    # one message instead of a traceback per rank (and per restart).
    resolve(cfg, Machine.detect(), world_size=nproc * max_nodes, local_world_size=nproc)
    # Before any rank starts: what the ranks are sent, and one batch through the job.
    check_picklable(extra, nproc)
    preflight_job(cfg, job)
    if multi_node:
        setup_logging(cfg.log.level, env)  # the agent says which interface and store host
    run_id_before, lock, made = os.environ.get(runlock.RUN_ID_ENV), None, []
    try:
        # Its run id goes to the ranks' env; ``made``: the folders this launch creates.
        cfg, lock, made = _plan_and_lock(cfg, multi_node)
        record_process(cfg.run.dir, "launcher")  # for `gpufleet cleanup RUN_DIR`
        results = launch(
            worker, (config_to_dict(cfg), *extra), nproc=nproc, launcher=launcher,
            nnodes=dist.nnodes, node_rank=dist.node_rank, master_addr=dist.master_addr,
            master_port=dist.master_port, rdzv_endpoint=dist.rdzv_endpoint,
            rdzv_backend=dist.rdzv_backend, rdzv_id=dist.rdzv_id or cfg.run.name,
            max_restarts=dist.max_restarts, rdzv_timeout=dist.rdzv_timeout,
            rdzv_last_call_s=dist.rdzv_last_call_s, rdzv_keep_alive_s=dist.rdzv_keep_alive_s)
        forget_process(cfg.run.dir)
    except RunStopped as e:  # the agent got the signal: the ranks' results are lost
        raise RunStopped(stopped_message(e.signal, cfg.run.dir), e.exit_code, e.signal) from None
    except BaseException:
        if made:  # e.g. the ranks never met: leave nothing half-written
            forget_process(cfg.run.dir)
            if lock is not None:
                lock.release()
                lock = None
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


def _plan_and_lock(cfg: Config, multi_node: bool) -> tuple[Config, Any, list[Path]]:
    """The launcher's run directory, locked for this run (see gpufleet.train.runlock),
    and the folders that did not exist before (a multi-node run's directory, which a
    launch whose ranks never met removes again)."""
    from gpufleet.procs import RECORDS_DIR
    from gpufleet.train import runlock
    from gpufleet.train.checkpoint import check_loadable, mark_verified
    from gpufleet.train.rundir import plan_and_lock

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
    return cfg, lock, []


def strategy_traits(cfg: Config) -> Any:
    """What the config's strategy asks of the run (``auto`` is ``ddp`` here: it asks for
    every visible GPU)."""
    from gpufleet.parallel import strategy_class

    name = cfg.parallel.strategy
    return strategy_class("ddp" if name == "auto" else name).traits


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first
        try:
            folder.rmdir()  # only empty folders go
        except OSError:
            pass


def _visible_gpus(cfg: Config) -> int:
    traits = strategy_traits(cfg)
    if traits.ranks_started_elsewhere:
        return 1  # one process here; horovodrun -np N starts more
    if cfg.run.device == "cpu":
        return 1
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if traits.one_process:
        return 1  # dp: one process drives every GPU; single: one process, one GPU
    return max(1, count)


def train(cfg: Config, callbacks: Sequence[Callback] = ()) -> FitResult:
    """Run the job a config describes (model and data named in it); what the CLI runs."""
    from gpufleet.job import build_job
    from gpufleet.launch import DistEnv
    from gpufleet.monitor.progress import Progress
    from gpufleet.train.rank import join_process_group
    from gpufleet.train.rundir import named

    cfg = named(cfg)  # from the factories' names, before the job builds the model
    # Resolve (the one time on this rank) and join first, so the job can build its data
    # with rank_zero_first; the trainer gets the resolved config.
    cfg = join_process_group(cfg, DistEnv.detect())
    # The same seed on every rank, so every rank builds the same initial weights.
    seed_everything(cfg.run.seed)
    job = build_job(cfg)
    run = build_run(cfg, job.model, job.train_data, job.eval_data, loss_fn=job.loss_fn,
                    callbacks=[Progress(cfg.log.progress), *callbacks])
    return Trainer(run).fit()


def run_worker(cfg_dict: dict[str, Any]) -> FitResult:
    """Entry point of each launched rank: rebuild the config, set up logging, train."""
    from gpufleet.launch import DistEnv, destroy_process_group

    cfg = config_from_dict(cfg_dict)
    setup_logging(cfg.log.level, DistEnv.detect())
    try:
        result = train(cfg)
    finally:
        destroy_process_group()
    if result.preempted and "TORCHELASTIC_RUN_ID" in os.environ:
        _exit_unless_collected(result.preempted)
    return result


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


