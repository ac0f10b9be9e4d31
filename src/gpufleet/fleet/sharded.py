"""``Fleet.save`` / ``Fleet.load`` of sharded models and optimizers (``fsdp``, ``hsdp``,
tensor parallel): a directory written by ``fit``'s sharded checkpointer
(:func:`gpufleet.train.checkpoint.sharded.write_sharded`).

Under a strategy whose ranks hold shards (``saves_on_every_rank``), ``fleet.save(path,
state)`` makes ``path`` a directory: every rank writes its shards of each model and
optimizer in ``state`` through ``torch.distributed.checkpoint`` (under their state
keys: ``model.<parameter>``, ``optimizer.state.<parameter>.exp_avg``, ...), rank 0 the
rest of the state (plain values, schedulers, loaders, every rank's RNG states, the
values kept per rank) as ``trainer.pt``, and ``MANIFEST.sha256`` lists every file's
SHA-256. The directory is built under a temporary name and renamed when complete; one
saved there before is replaced only then. ``fleet.load`` checks the manifest and DCP's
metadata first, then every rank reads what makes up its own shards: the directory
loads at another world size (fsdp 2 ranks into 1), and into ``single`` and ``ddp``
loops too (whole tensors).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.fleet.wrappers import FleetModule, unwrap_optimizer
from gpufleet.launch import broadcast_object, is_initialized
from gpufleet.parallel.fsdp import keyed_by_name
from gpufleet.parallel.tensor import without_strided
from gpufleet.train.checkpoint import sharded as sharded_ckpt

log = logging.getLogger(__name__)


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory ``Fleet.save`` wrote under a sharded strategy
    (or, after a crash while it was being replaced, the previous one kept aside)."""
    path = Path(path)
    return path.is_dir() or (not path.exists()
                             and sharded_ckpt.previous_name(path).is_dir())


def module_of(value: nn.Module, strategy: Any) -> nn.Module:
    """The module whose state dict is saved: your own (no wrapper's prefix)."""
    return value.module if isinstance(value, FleetModule) else strategy.unwrap(value)


def shard_entries(state: Mapping[str, Any], strategy: Any, placed: Iterable[nn.Module],
                  filter: Mapping[str, Callable[[str, Any], bool]] | None = None
                  ) -> dict[str, Any]:
    """Each model and optimizer of ``state`` as the shards this rank holds (DTensors,
    keyed by parameter name), as DCP writes them; ``filter`` as in ``Fleet.save``."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        entry: dict[str, Any]
        if isinstance(value, nn.Module):
            entry = get_model_state_dict(module_of(value, strategy))
        elif isinstance(unwrap_optimizer(value), Optimizer):
            inner = unwrap_optimizer(value)
            entry = get_optimizer_state_dict(owner_of(inner, placed, key), inner)
        else:
            continue
        if filter and key in filter:
            entry = {k: v for k, v in entry.items() if filter[key](k, v)}
        out[key] = entry
    # Head-split (tensor parallel) tensors whole over their tp ranks: DCP cannot
    # describe strided shards (FSDP's stay, so each rank still writes only its part).
    return without_strided(out)


def owner_of(optimizer: Optimizer, placed: Iterable[nn.Module], key: str) -> nn.Module:
    """The set-up model whose parameters ``optimizer`` steps (DCP names its state by
    that model's parameter names).

    Raises:
        ConfigError: no model set up by this Fleet holds them all.
    """
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in placed:
        if held <= {id(p) for p in model.parameters()}:
            return model
    raise ConfigError(
        f"Fleet.save / load: the optimizer under {key!r} steps parameters of no model set "
        "up by this Fleet, and a sharded checkpoint names optimizer state by the model's "
        "parameter names. Set the model up with fleet.setup(model, optimizer), or build "
        "the optimizer on the parameters of the model setup_module returned.")


def verify(path: Path) -> Path:
    """The directory to read at ``path`` once its manifest checks (rank 0 hashes every
    file; the others learn the outcome). After a crash while the previous directory
    was being replaced, that previous one, with a warning.

    COLLECTIVE where a process group exists.

    Raises:
        CheckpointError: on every rank, a file is missing or not what was written.
    """
    if not path.exists() and sharded_ckpt.previous_name(path).is_dir():
        log.warning("%s is missing; the checkpoint it replaced, complete, is read from %s "
                    "(the process stopped while renaming)", path,
                    sharded_ckpt.previous_name(path))
        path = sharded_ckpt.previous_name(path)
    error = None
    if _rank() == 0:
        try:
            sharded_ckpt.verify_sharded(path)
        except CheckpointError as e:
            error = str(e)
    error = broadcast_object(error)  # COLLECTIVE: every rank learns rank 0's check
    if error is not None:
        raise CheckpointError(error)
    return path


def load_entries(path: Path, state: dict[str, Any], keys: Iterable[str], strategy: Any,
                 placed: Iterable[nn.Module], strict: bool) -> list[str]:
    """Read the models and optimizers under ``keys`` of ``state`` from the directory at
    ``path`` into them, in place, resharded to this run; returns what a non-strict load
    skipped (a model's names the checkpoint lacks).

    COLLECTIVE: every rank reads the parts of the saved shards that make up its own.

    Raises:
        CheckpointError: the checkpoint does not fit these models or optimizers.
    """
    placed = list(placed)
    keys = list(keys)
    like: dict[str, Any] = {}
    targets: dict[str, tuple[nn.Module, Optimizer | None]] = {}
    saved = sharded_ckpt.saved_keys(path) if not strict else set()
    skipped: list[str] = []
    for key in keys:
        value = state[key]
        if isinstance(value, nn.Module):
            module = module_of(value, strategy)
            entry = get_model_state_dict(module)
            if not strict:  # only the names the checkpoint has
                lacking = [n for n in entry if f"{key}.{n}" not in saved]
                entry = {n: t for n, t in entry.items() if n not in lacking}
                if lacking:
                    skipped.append(f"{key!r} missing keys {', '.join(lacking)}")
            like[key], targets[key] = entry, (module, None)
        else:
            inner = unwrap_optimizer(value)
            if strategy.traits.consolidates_optimizer:
                raise CheckpointError(
                    f"{path} holds the optimizer {key!r} sharded by parameter (fsdp, tp), "
                    f"and strategy {strategy.name!r} keeps its own split of the optimizer "
                    "state: load it with strategy='fsdp', 'ddp' or 'single'.")
            owner = owner_of(inner, placed, key)
            # DCP needs the state's tensors to fill: a fresh optimizer gets them from
            # one step with zero gradients at learning rate 0 (torch's own init).
            like[key], targets[key] = get_optimizer_state_dict(owner, inner), (owner, inner)
    try:
        loaded = sharded_ckpt.read_shards(path, like)
        for key, (module, optimizer) in targets.items():
            if optimizer is None:
                set_model_state_dict(module, loaded[key],
                                     options=StateDictOptions(strict=strict))
            else:
                set_optimizer_state_dict(module, optimizer, loaded[key])
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(
            f"{path} does not fit the models and optimizers given ({', '.join(keys)}): "
            f"{str(e).splitlines()[0][:500]}. It was written for other models or "
            "optimizers; load it into the ones it was saved from.") from e
    return skipped


def load_whole(value: Any, saved: Any, strategy: Any, placed: Iterable[nn.Module],
               key: str, strict: bool) -> list[str]:
    """A model's or optimizer's whole state dict (from a file saved where every rank
    held the whole model: ``single``, ``ddp``) loaded into ``value``, which this run
    shards (each rank keeps its part); returns what a non-strict load skipped.

    COLLECTIVE under tensor parallel (the split tensors are distributed)."""
    whole = StateDictOptions(full_state_dict=True, strict=strict)
    if isinstance(value, nn.Module):
        result = set_model_state_dict(module_of(value, strategy), saved, options=whole)
        return [f"{key!r} {kind.replace('_', ' ')} {', '.join(names)}"
                for kind, names in (("missing_keys", result.missing_keys),
                                    ("unexpected_keys", result.unexpected_keys)) if names]
    inner = unwrap_optimizer(value)
    owner = owner_of(inner, placed, key)
    if saved.get("state") and all(isinstance(k, int) for k in saved["state"]):
        saved = keyed_by_name(owner, inner, saved)  # torch.optim's form: by index
    set_optimizer_state_dict(owner, inner, saved, options=whole)
    return []


def _rank() -> int:
    return dist.get_rank() if is_initialized() else 0
