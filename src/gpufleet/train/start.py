"""Start a run from the process the user ran: check it once, then train here or start
the ranks.

Before any rank starts, the launching process checks the whole config and runs a
preflight: one small batch through the model and the loss, forward only, on the CPU.
A config mistake (a missing ``--model.loss``, data the model cannot take) then reads
as one line, before a run directory, a crash report or a rank exists, instead of a
traceback from every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
from collections.abc import Callable
from typing import Any

import torch

from gpufleet.config import Config, Machine, config_to_dict, resolve
from gpufleet.errors import ConfigError

log = logging.getLogger(__name__)

PREFLIGHT_SAMPLES = 2


def preflight(model: torch.nn.Module, train_data: Any, loss_fn: Any, cfg: Config) -> None:
    """Run ``PREFLIGHT_SAMPLES`` training samples through ``model`` and its loss.

    Forward only, without gradients, in eval mode (BatchNorm statistics and dropout are
    left alone), on the CPU in float32, and the model's mode is put back afterwards.

    Raises:
        ConfigError: the batch, the model or the loss failed, with what failed and why.
    """
    if not cfg.run.preflight:
        return
    from gpufleet.data.loaders import train_collate
    from gpufleet.train.batches import make_loss_fn

    try:
        count = min(PREFLIGHT_SAMPLES, len(train_data))
        batch = train_collate(train_data, cfg.data)([train_data[i] for i in range(count)])
    except Exception as e:
        raise ConfigError(_failed("reading the first training samples", e, cfg)) from None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            make_loss_fn(loss_fn)(model, batch)
    except Exception as e:
        raise ConfigError(_failed(f"a batch of {count} sample(s) through the model and its "
                                  "loss", e, cfg)) from None
    finally:
        model.train(was_training)
    log.info("preflight: a batch of %d sample(s) went through the model and its loss", count)


def _failed(what: str, error: Exception, cfg: Config) -> str:
    text = " ".join(str(error).split()) or "(no message)"
    return (f"preflight: {what} failed before training started: {type(error).__name__}: "
            f"{text} (The preflight runs on the CPU; turn it off with "
            "--run.preflight=false if the model only runs on a GPU.)")


def check_picklable(what: dict[str, Any], nproc: int) -> None:
    """Refuse, naming the culprit, to send ranks objects that cannot be pickled (or
    that the new processes could not import: defined in a notebook or the REPL)."""
    interactive = not getattr(sys.modules.get("__main__"), "__file__", None)
    for name, value in what.items():
        module = getattr(value, "__module__", None) or type(value).__module__
        if interactive and "__main__" in (module, type(value).__module__):
            raise ConfigError(
                f"dist.nproc = {nproc} starts {nproc} new processes, and the {name} is "
                "defined in this interactive session, which they cannot import. Move it to "
                "a .py file and import it from there.")
        try:
            pickle.dumps(value)
        except Exception as e:
            raise ConfigError(
                f"dist.nproc = {nproc} starts {nproc} new processes and sends each the "
                f"{name}, which cannot be pickled ({type(e).__name__}: {e}). Define it at "
                "module level in a file that can be imported (and guard the script with "
                "if __name__ == '__main__':), or start the script with torchrun "
                f"--nproc-per-node {nproc} so that every rank builds its own.") from None


def start_run(cfg: Config, worker: Callable[..., Any], extra: tuple = (),
              job: Any = None) -> Any:
    """Train here, or start the ranks and train there; returns rank 0's result.

    Args:
        cfg: the run's config (named: ``run.name`` set).
        worker: what each rank runs, ``worker(cfg_dict, *extra)``.
        extra: further arguments for ``worker`` (sent to every rank: picklable).
        job: the model, data and loss to preflight (a :class:`gpufleet.job.Job`);
            None builds the job the config names, for the preflight only.
    """
    from gpufleet.launch import launch
    from gpufleet.procs import forget_process, record_process

    dist = cfg.dist
    if cfg.parallel.strategy == "horovod" and dist.nproc > 1:
        raise ConfigError(
            f"--nproc {dist.nproc} with --strategy horovod: Horovod's ranks are started by "
            f"horovodrun, not by gpufleet. Run: horovodrun -np {dist.nproc} gpufleet train "
            "--strategy horovod ... (without --nproc).")
    nproc = dist.nproc or _visible_gpus(cfg)
    max_nodes = int(dist.nnodes.split(":")[-1])
    multi_node = max_nodes > 1
    launcher = dist.launcher
    if launcher == "auto":
        needs_agent = nproc > 1 or multi_node or dist.max_restarts > 0
        launcher = "elastic" if needs_agent else "none"
    if launcher == "none" and (nproc > 1 or multi_node):
        raise ConfigError(f"dist.launcher = 'none' runs one process, but {nproc} rank(s) "
                          f"on {dist.nnodes} node(s) were asked for. Use "
                          "--launcher elastic (or spawn), or --nproc 1.")
    # Check the whole config here, once, before any rank starts: a mistake then reads as
    # one message instead of a traceback per rank (and per restart).
    resolve(cfg, Machine.detect(), world_size=nproc * max_nodes, local_world_size=nproc)
    cfg = dataclasses.replace(cfg, dist=dataclasses.replace(dist, nproc=nproc,
                                                            launcher=launcher))
    if launcher == "none":
        # One process: a mistake surfaces here anyway, and the data set is read by this
        # process alone (a preflight would read from it before the run does).
        return worker(config_to_dict(cfg), *extra)
    check_picklable(dict(zip(("model", "training data", "evaluation data", "loss function",
                              "callbacks"), extra, strict=False)), nproc)
    _preflight_job(cfg, job)
    cfg = _plan_run_dir(cfg, multi_node)
    record_process(cfg.run.dir, "launcher")  # for `gpufleet cleanup RUN_DIR`
    results = launch(
        worker, (config_to_dict(cfg), *extra), nproc=nproc, launcher=launcher,
        nnodes=dist.nnodes, node_rank=dist.node_rank, master_addr=dist.master_addr,
        master_port=dist.master_port, rdzv_endpoint=dist.rdzv_endpoint,
        rdzv_backend=dist.rdzv_backend, rdzv_id=dist.rdzv_id or cfg.run.name,
        max_restarts=dist.max_restarts)
    forget_process(cfg.run.dir)
    return results.get(0)


def _plan_run_dir(cfg: Config, multi_node: bool) -> Config:
    """The run directory every rank (and every restart) of the job writes to."""
    from gpufleet.train.checkpoint import mark_verified
    from gpufleet.train.rundir import plan_run

    if not multi_node:
        cfg, resume_from = plan_run(cfg)
        if resume_from is not None and resume_from.is_file():
            mark_verified(resume_from)  # checked just now: rank 0 need not hash it again
        return cfg
    # Every node must agree on the run directory without talking to each other.
    if cfg.run.dir:
        return cfg
    if not cfg.dist.rdzv_id:
        raise ConfigError(
            "a multi-node run needs a run directory that every node agrees on. "
            "Pass --rdzv-id NAME (the run writes to <out_dir>/<name>-NAME) or "
            "--run-dir PATH, on a file system all nodes share.")
    run_dir = f"{cfg.run.out_dir}/{cfg.run.name}-{cfg.dist.rdzv_id}"
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=run_dir))


def _preflight_job(cfg: Config, job: Any) -> None:
    if not cfg.run.preflight:
        return
    if job is None:
        from gpufleet.job import build_job
        from gpufleet.train.seed import seed_everything

        seed_everything(cfg.run.seed)
        job = build_job(cfg)
    preflight(job.model, job.train_data, job.loss_fn, cfg)


def _visible_gpus(cfg: Config) -> int:
    if cfg.parallel.strategy == "horovod":
        return 1  # one process here; horovodrun -np N starts more
    if cfg.run.device == "cpu":
        return 1
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.parallel.strategy in ("dp", "single"):
        return 1  # dp: one process drives every GPU; single: one process, one GPU
    return max(1, count)
