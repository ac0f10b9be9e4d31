"""The Python API: train your own module and data set without writing a loop.

Example:
    >>> import torch, gpufleet
    >>> model = torch.nn.Linear(8, 1)
    >>> data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    >>> result = gpufleet.fit(model, data, loss_fn=torch.nn.functional.mse_loss,
    ...                       overrides={"run.max_steps": 20, "log.progress": "off"})
    ... # doctest: +SKIP

Under ``torchrun`` (or ``gpufleet.launch``) the same call trains on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, default_collate

from gpufleet.config import Config, load_config
from gpufleet.core.callbacks import Callback
from gpufleet.data.hf import hf_train_eval
from gpufleet.data.loaders import check_stream
from gpufleet.entry import run_rank, run_training, setup_logging, start_ranks, train
from gpufleet.errors import ConfigError
from gpufleet.job import Job
from gpufleet.launch import DistEnv
from gpufleet.plan import make_plan
from gpufleet.train.checkpoint.format import load_into
from gpufleet.train.checkpoint.rundir import as_new_run
from gpufleet.train.engine.build import build_run
from gpufleet.train.engine.result import FitResult
from gpufleet.train.engine.steps import check_strategy
from gpufleet.train.loop import Trainer

# train and run_rank live in gpufleet.entry (the launcher calls them); this is where
# user code has always found them. A run of one rank trains in the caller's process:
# the training stack (build_run, Trainer) is imported with this module, as a user's
# import line pays for it, and not on the way to the first step.
__all__ = ["Trainer", "build_run", "fit", "load_checkpoint", "run_rank", "run_training",
           "setup_logging", "train"]

log = logging.getLogger(__name__)


def fit(model: nn.Module, train_data: Dataset, eval_data: Dataset | None = None, *,
        loss_fn: Any = None, config: Config | str | None = None,
        overrides: Mapping[str, Any] | Sequence[str] = (),
        callbacks: Sequence[Callback] = (),
        eval_metrics: Mapping[str, Any] | None = None,
        optimizer: Any = None, scheduler: Any = None,
        training_step: Any = None) -> FitResult:
    """Train ``model`` on ``train_data``; returns the :class:`FitResult`.

    Args:
        model: your module. Its forward returns a scalar loss, or give ``loss_fn`` or
            ``training_step``. Several models (a GAN): a dict ``{name: module}`` with a
            ``training_step`` (ddp or single).
        train_data: a map-style Dataset of ``(inputs, target)``, tuples or dicts; or a
            Hugging Face ``datasets.Dataset`` / ``DatasetDict`` (train + validation); or
            a stream (an ``IterableDataset`` giving every process the same items): each
            rank reads its own batches of it, every item once, its position saved in
            checkpoints; ``run.max_steps`` says when to stop (``run.max_epochs`` is
            refused: a stream has no length), and an epoch is a pass of the stream.
        eval_data: optional evaluation Dataset (evaluated every ``run.eval_every``), or
            a stream, read to its end (or ``run.eval_batches``) at each evaluation.
        loss_fn: ``loss(output, target)``, e.g. ``torch.nn.functional.cross_entropy``.
        config: a :class:`Config`, a TOML path, or None for the defaults.
        overrides: ``{"optim.lr": 1e-3}`` or ``["optim.lr=1e-3"]`` applied on top.
        callbacks: extra :class:`~gpufleet.core.callbacks.Callback` objects.
        eval_metrics: your own metrics, ``{"f1": fn}`` with ``fn(output, target)``
            returning the batch's mean or ``(sum, count)``; besides ``eval.metrics``.
        optimizer: your optimizer: any ``torch.optim`` optimizer built on ``model``'s
            parameters (parameter groups welcome), or ``fn(params)`` returning one. It
            replaces ``[optim]``'s, and nothing is added to it: no clipping, warm-up or
            schedule unless the config asks. gpufleet builds it again, with the same
            settings, on the parameters the strategy placed (DDP, FSDP shards, ZeRO).
        scheduler: your LR scheduler: an object built on that optimizer, or
            ``fn(optimizer)``; stepped every optimizer step, or every epoch with
            ``sched.interval = "epoch"``. With several models: a dict of optimizers
            (and of schedulers) by model name, or a factory called per model.
        training_step: your ``fn(models, batch, step)`` returning the loss, or a dict of
            losses logged under their keys (see :mod:`gpufleet.train.engine.steps`: which
            ones drive backward, and how several models each get their own).

    With ``overrides={"dist.nproc": 2}`` (and no ranks started yet) fit starts the ranks
    itself (torch's elastic agent) and sends each the model, the data, the loss and the
    callbacks, which must be picklable: defined at module level of an importable file,
    with the script's own work under ``if __name__ == "__main__":``. It returns rank 0's
    result. Under torchrun every rank calls fit and trains its share.
    """
    _check_not_loaders(train_data=train_data, eval_data=eval_data)
    cfg, note = _config(config, overrides)

    env = DistEnv.detect()
    if not logging.getLogger().handlers:  # leave a logging setup of the user's alone
        setup_logging(cfg.log.level, env)
    if note:
        log.info("%s", note)
    # Ranks are started only when asked for (several processes or nodes); else this
    # process trains, as the run's one rank or as its rank of a torchrun job.
    asks_for_ranks = cfg.dist.nproc > 1 or cfg.dist.nnodes != "1"
    plan = make_plan(cfg, env, model=model, here=not asks_for_ranks)  # the one resolve
    # What the strategy cannot train is refused here, before any rank starts.
    check_strategy(plan.cfg.parallel.strategy, isinstance(model, Mapping) and len(model) > 1,
                   training_step is not None or bool(plan.cfg.model.training_step))
    if isinstance(train_data, IterableDataset):  # a stream: what it cannot be asked for
        check_stream(plan.cfg, train_data)
    # A Hugging Face DatasetDict gives its train and validation splits.
    train_data, eval_data = hf_train_eval(train_data, eval_data)
    job = Job(model, train_data, eval_data, loss_fn, optimizer, scheduler, training_step)
    return start_ranks(plan, job, callbacks,
                       eval_metrics, owns_process=False)


def _check_not_loaders(**data: Any) -> None:
    """fit builds the DataLoader (sharded, resumable): a DataLoader given in place of its
    Dataset is named, with what to pass instead, before anything starts."""
    for name, given in data.items():
        if not isinstance(given, DataLoader):
            continue
        keep = {"data.batch_size": given.batch_size,
                "data.shuffle": isinstance(given.sampler, RandomSampler)}
        own_collate = given.collate_fn is not default_collate
        raise ConfigError(
            f"fit takes a Dataset and builds its DataLoader itself (sharded over the "
            f"ranks, resumable at any batch); {name} is a DataLoader. Pass its dataset "
            f"with your loader's settings: fit(model, loader.dataset, overrides={keep!r})"
            + (", and give the dataset your collate function (dataset.collate_fn = "
               "loader.collate_fn)" if own_collate else "")
            + "; or keep your DataLoader and write the loop with gpufleet.Fleet "
              "(setup_dataloaders).")


def _config(config: Config | str | None, overrides: Any) -> tuple[Config, str]:
    """The config and, when it came from a run's own config.toml, a note that this
    starts a new run."""
    if isinstance(config, Config):
        return load_config(overrides=overrides, base=config), ""
    base, note = None, ""
    if config is not None:
        base, note = as_new_run(load_config(config), config)
    return load_config(overrides=overrides, base=base), note


def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a run's checkpoint into your own module (and optimizer), with no trainer.

    Args:
        path: a checkpoint (``runs/X/checkpoints/step-0000400.pt``), a sharded
            checkpoint's directory, or a run directory (its newest checkpoint).
        model: your module, built as the run built it; for a run of several models, a
            dict of them by name.
        optimizer: also restore this optimizer's state (runs whose optimizer state is
            in torch's own layout: single, ddp, local_sgd); a dict by model name for a
            run of several.

    Returns:
        The rest of the checkpoint (``step``, ``epoch``, ``config``, ...).

    Example:
        >>> # model = MyNet()
        >>> # info = gpufleet.load_checkpoint("runs/mynet-20261124-101500", model)
        >>> # print(info["step"]); model.eval()
    """
    return load_into(path, model, optimizer)
