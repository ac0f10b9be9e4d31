"""``Fleet.save`` and ``Fleet.load`` of a pipeline's stages: the whole model in one file.

Under ``pipeline`` each rank holds one stage of the model and an optimizer over that
stage's parameters, so neither rank's own state dict is the model's. At save the
strategy gathers every stage's model and optimizer state into the whole model's, laid
out as a ``single`` run's (:meth:`gpufleet.parallel.pipeline.PipelineParallel.state_dict`,
what ``fit``'s checkpoints of a pipeline hold: COLLECTIVE), and rank 0 writes it in the
one file; at load each stage takes its own share of it
(:meth:`~gpufleet.parallel.pipeline.PipelineParallel.load_state_dict`). The file is
then the same as one a loop of one process saves, and loads there too.

With ``dp`` or ``tp`` above 1 the stages are sharded and saved as a directory of shards
instead (:mod:`~gpufleet.fleet.sharded`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer

from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.fleet.wrappers import FleetModule, unwrap_optimizer
from gpufleet.launch import gather_objects


def holds_stages(strategy: Any) -> bool:
    """Whether each rank holds another stage of the model, saved whole in one file."""
    return bool(strategy.traits.pipelined) and not strategy.saves_on_every_rank


def _stage_keys(state: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The keys of ``state`` holding the set-up stage and its optimizer (None: none)."""
    models = [k for k, v in state.items() if isinstance(v, FleetModule)]
    optimizers = [k for k, v in state.items() if isinstance(unwrap_optimizer(v), Optimizer)]
    if len(models) > 1 or len(optimizers) > 1:
        raise ConfigError(
            f"Fleet.save under parallel.strategy = 'pipeline': the state holds "
            f"{len(models)} model(s) and {len(optimizers)} optimizer(s); a pipeline trains "
            "one model, split into stages, with one optimizer. Save that model and its "
            "optimizer, e.g. {'model': model, 'optimizer': optimizer, ...}.")
    return (models[0] if models else None), (optimizers[0] if optimizers else None)


def stage_entries(state: Mapping[str, Any], strategy: Any) -> dict[str, Any]:
    """The whole model's and optimizer's state for the entries of ``state`` holding
    this rank's stage and its optimizer (COLLECTIVE: every rank calls it; each gets
    the whole state). Empty when ``state`` holds neither.

    Raises:
        ConfigError: the optimizer without the model, or several of either.
    """
    model_key, opt_key = _stage_keys(state)
    if model_key is None and opt_key is None:
        return {}
    if model_key is None:
        raise ConfigError(
            "Fleet.save under parallel.strategy = 'pipeline': the optimizer's state is laid "
            "out by the whole model's parameter names, which the model's entry gives. Save "
            "the model with it: {'model': model, 'optimizer': optimizer}.")
    model = state[model_key]
    if opt_key is None:  # the model alone: every stage's weights, the whole model's
        whole: dict[str, Any] = {}
        for part in gather_objects(_cpu(model.placed.state_dict())):  # COLLECTIVE
            whole.update(part)
        return {model_key: whole}
    full = strategy.state_dict(model.placed, unwrap_optimizer(state[opt_key]))
    return {model_key: full["model"], opt_key: full["optimizer"]}


def load_stage_entries(state: Mapping[str, Any], saved: dict[str, Any],
                       strategy: Any) -> list[str]:
    """Load this rank's stage and its optimizer from the whole model's state in
    ``saved`` (what :func:`stage_entries` wrote); returns the keys loaded.

    Raises:
        CheckpointError: the file's model lacks a weight of this stage, or its optimizer
            state does not fit this model's parameter groups.
    """
    model_key, opt_key = _stage_keys(state)
    if model_key is None or model_key not in saved:
        if opt_key is not None and opt_key in saved:
            raise CheckpointError(
                "Fleet.load under parallel.strategy = 'pipeline': the optimizer's state "
                "is laid out by the whole model's parameter names; load the model with "
                "it: fleet.load(path, {'model': model, 'optimizer': optimizer}).")
        return []
    stage: nn.Module = state[model_key].placed
    full = saved[model_key]
    missing = [k for k in stage.state_dict() if k not in full]
    if missing:
        raise CheckpointError(
            f"the checkpoint's model lacks {', '.join(missing[:5])} of this pipeline "
            "stage: it was saved from another model. Load a checkpoint of this model.")
    if opt_key is None or opt_key not in saved:
        stage.load_state_dict({k: full[k] for k in stage.state_dict()})
        return [model_key]
    try:
        strategy.load_state_dict(stage, unwrap_optimizer(state[opt_key]),
                                 {"model": full, "optimizer": saved[opt_key]})
    except ValueError as e:
        raise CheckpointError(f"the checkpoint's optimizer state does not fit this "
                              f"pipeline's optimizer: {e}. Load a checkpoint saved with "
                              "the same optimizer parameter groups.") from e
    return [model_key, opt_key]


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if hasattr(v, "detach") else v for k, v in state.items()}
