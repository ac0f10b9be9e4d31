"""Checks the launching process makes before ranks start (``gpufleet.entry.run_training``).

Before any rank starts, the launching process checks the whole config and runs a
preflight: one small batch through the model and the loss, forward only, on the CPU.
A config mistake (a missing ``--model.loss``, data the model cannot take) then reads
as one line, before a run directory, a crash report or a rank exists, instead of a
traceback from every rank.
"""

from __future__ import annotations

import logging
import pickle
import sys
from typing import Any

import torch
from torch.utils.data import IterableDataset

from gpufleet.config import Config
from gpufleet.data.loaders import check_stream, first_samples
from gpufleet.errors import ConfigError
from gpufleet.parallel import strategy_class, strategy_names
from gpufleet.parallel.pipeline_split import check_stage_loss

log = logging.getLogger(__name__)

PREFLIGHT_SAMPLES = 2


def preflight(model: Any, train_data: Any, loss_fn: Any, cfg: Config,
              training_step: Any = None) -> None:
    """Run ``PREFLIGHT_SAMPLES`` training samples through ``model`` and its loss (or
    through your ``training_step``, as step 0, with the model or dict of models).

    Forward only, without gradients, in eval mode (BatchNorm statistics and dropout are
    left alone), on the CPU in float32, and the model's mode is put back afterwards.

    Raises:
        ConfigError: the batch, the model or the loss failed, with what failed and why.
    """
    if not cfg.run.preflight:
        return
    from gpufleet.data.loaders import train_collate
    from gpufleet.train.engine.batches import make_loss_fn

    try:
        samples = first_samples(train_data, PREFLIGHT_SAMPLES)
        count = len(samples)
        batch = train_collate(train_data, cfg.data)(samples)
    except Exception as e:
        raise ConfigError(_failed("reading the first training samples", e, cfg)) from None
    from gpufleet.train.engine.steps import named_models, split_losses

    models = named_models(model)
    was_training = {name: m.training for name, m in models.items()}
    for m in models.values():
        m.eval()
    try:
        with torch.no_grad():
            if training_step is None:
                make_loss_fn(loss_fn)(model, batch)
            else:
                split_losses(training_step(model, batch, 0), list(models))
    except ConfigError as e:  # the step's return value, named already
        raise ConfigError(f"preflight: {e}") from None
    except Exception as e:
        from gpufleet.train.batch_check import explain_batch

        reason = explain_batch(model, batch) if training_step is None else None
        if reason is not None:
            raise ConfigError(f"preflight: {reason}") from None
        what = "the model and its loss" if training_step is None else "your training_step"
        raise ConfigError(_failed(f"a batch of {count} sample(s) through {what}", e,
                                  cfg)) from None
    finally:
        for name, m in models.items():
            m.train(was_training[name])
    log.info("preflight: a batch of %d sample(s) went through the model and its loss", count)


def _failed(what: str, error: Exception, cfg: Config) -> str:
    text = " ".join(str(error).split()) or "(no message)"
    message = (f"preflight: {what} failed before training started: "
               f"{type(error).__name__}: {text}")
    if is_device_mismatch(error):
        message += (" (The preflight runs on the CPU; turn it off with "
                    "--run.preflight=false if the model only runs on a GPU.)")
    return message


# Phrases torch uses when a tensor or an operation needs a device the CPU is not.
_DEVICE_PHRASES = ("same device", "cuda", "device type", "nvidia driver", "mps",
                   "xpu", "not compiled with")


def is_device_mismatch(error: Exception) -> bool:
    """True when ``error`` says a tensor or an operation needs another device than the
    CPU, the one failure for which turning the preflight off is the fix."""
    text = str(error).lower()
    return any(phrase in text for phrase in _DEVICE_PHRASES)


# What gpufleet.fit sends to the ranks it starts, in the order it passes them.
_SENT = ("model", "training data", "evaluation data", "loss function", "callbacks",
         "optimizer", "scheduler", "training step")


def check_picklable(extra: tuple, nproc: int) -> None:
    """Refuse, naming the culprit, to send ranks objects that cannot be pickled (or
    that the new processes could not import: defined in a notebook or the REPL).

    Everything is pickled once, together, as the ranks get it (an optimizer and a
    scheduler hold the model's parameters: pickled one by one, the model would be
    pickled three times); only when that fails is each object pickled on its own, to
    name the one that cannot be sent."""
    interactive = not getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        pickle.dumps(tuple(extra), protocol=pickle.HIGHEST_PROTOCOL)
        sendable = True
    except Exception:
        sendable = False
    for name, value in zip(_SENT, extra, strict=False):
        module = getattr(value, "__module__", None) or type(value).__module__
        if interactive and "__main__" in (module, type(value).__module__):
            raise ConfigError(
                f"dist.nproc = {nproc} starts {nproc} new processes, and the {name} is "
                "defined in this interactive session, which they cannot import. Move it to "
                "a .py file and import it from there.")
        if sendable:
            continue
        try:
            pickle.dumps(value)
        except Exception as e:
            raise ConfigError(
                f"dist.nproc = {nproc} starts {nproc} new processes and sends each the "
                f"{name}, which cannot be pickled ({type(e).__name__}: {e}). Define it at "
                "module level in a file that can be imported (and guard the script with "
                "if __name__ == '__main__':), or start the script with torchrun "
                f"--nproc-per-node {nproc} so that every rank builds its own.") from None


def preflight_job(cfg: Config, job: Any = None) -> Any:
    """:func:`preflight` for ``job`` (a :class:`gpufleet.job.Job`), or for the job the
    config names, built here for the check only (each rank builds its own: a factory
    may build differently on each rank); before it, what the strategy cannot train (a
    training step, several models) is refused.

    Returns:
        The job checked (None when the preflight is off and no job was given).
    """
    _check_strategy(cfg, job)
    if not cfg.run.preflight:
        return job
    if job is None:
        from gpufleet.job import build_job
        from gpufleet.train.seed import seeded

        with seeded(cfg.run.seed):  # as each rank builds it (gpufleet.entry.run_rank)
            job = build_job(cfg)
        _check_strategy(cfg, job)  # now it is known whether the factory made several
    if isinstance(job.train_data, IterableDataset):
        check_stream(cfg, job.train_data)  # (each rank checks again: data/loaders.py)
    preflight(job.model, job.train_data, job.loss_fn, cfg, job.training_step)
    if cfg.parallel.strategy in strategy_names() \
            and strategy_class(cfg.parallel.strategy).traits.pipelined:
        check_stage_loss(job.model, job.loss_fn)  # the whole model ran; its stages won't
    return job


def _check_strategy(cfg: Config, job: Any) -> None:
    from gpufleet.train.engine.steps import check_strategy

    several = job is not None and isinstance(job.model, dict) and len(job.model) > 1
    has_step = bool(cfg.model.training_step) or (
        job is not None and job.training_step is not None)
    check_strategy(cfg.parallel.strategy, several, has_step)
