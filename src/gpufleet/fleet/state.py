"""``Fleet.save`` and ``Fleet.load``: your state dict of models, optimizers, loaders and
plain values, written atomically with a checksum and read with ``weights_only=True``.

What goes in a file: each model's own state dict (no ``module.`` prefix), each
optimizer's and scheduler's state dict, each set-up loader's position, your plain values
as they are, and every rank's RNG states (so dropout and your own random draws continue
exactly). Rank 0 writes through :func:`~gpufleet.train.checkpoint.write_checkpoint_file`
(a temporary name, fsync, rename, a ``.sha256`` beside it); every rank reads through
:func:`~gpufleet.train.checkpoint.load_checkpoint` (the checksum checked, nothing in the
file can run code).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.fleet.wrappers import FleetModule
from gpufleet.launch import barrier, gather_objects
from gpufleet.train.checkpoint import load_checkpoint, write_checkpoint_file
from gpufleet.train.checkpoint_files import FORMAT_VERSION
from gpufleet.train.seed import rng_state, set_rng_state

log = logging.getLogger(__name__)

#: The key under which a Fleet file keeps what it adds (every rank's RNG states).
FLEET_KEY = "_fleet"


def _has_state(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


def saveable(state: Mapping[str, Any], strategy: Any) -> dict[str, Any]:
    """``state`` with every stateful object replaced by its state dict."""
    if strategy.saves_on_every_rank:
        raise ConfigError(
            f"Fleet.save with parallel.strategy = {strategy.name!r}: each rank holds a "
            "shard, and Fleet writes one file from rank 0. Use strategy='ddp' (or "
            "'single') with Fleet.save, or train the sharded model with gpufleet.fit, "
            "whose checkpoints are sharded.")
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key == FLEET_KEY:
            raise ConfigError(f"state key {FLEET_KEY!r} is Fleet's own; rename yours.")
        if isinstance(value, nn.Module):
            # A FleetModule's is your module's own; a module you placed yourself unwraps.
            out[key] = value.state_dict() if isinstance(value, FleetModule) \
                else strategy.unwrap(value).state_dict()
        elif strategy.traits.consolidates_optimizer and isinstance(value, Optimizer):
            # zero1: each rank holds a shard of the optimizer state
            raise ConfigError(
                f"Fleet.save got a sharded optimizer ({type(value).__name__}) under {key!r}; "
                "Fleet writes one file from rank 0. Use strategy='ddp' with Fleet.save, or "
                "gpufleet.fit, whose checkpoints gather the shards.")
        elif _has_state(value):  # optimizers, schedulers, Fleet loaders, scalers
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


def save_state(path: str | Path, state: Mapping[str, Any], strategy: Any,
               rank: int) -> Path:
    """Write ``state`` to ``path`` (COLLECTIVE: every rank calls it; rank 0 writes).

    Raises:
        OSError: the write failed; nothing is left under ``path``'s name and an older
            file there is untouched.
    """
    path = Path(path)
    content = saveable(state, strategy)
    rngs = gather_objects(rng_state())  # COLLECTIVE: every rank's RNG states
    error: OSError | None = None
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_checkpoint_file(path, {"format": FORMAT_VERSION, **content,
                                         FLEET_KEY: {"rng": rngs}})
        except OSError as e:
            error = e
    errors = gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    barrier()  # COLLECTIVE: no rank reads the file before it is complete
    if error is not None:
        raise error
    if errors[0] is not None:
        raise OSError(f"rank 0 could not write {path}: {errors[0]}")
    return path


def load_state(path: str | Path, state: dict[str, Any], strategy: Any,
               rank: int, world_size: int) -> dict[str, Any]:
    """Restore ``path`` into ``state`` in place: objects load their state dicts, plain
    values are replaced. Returns what the file holds that ``state`` did not ask for.

    Raises:
        CheckpointError: the file is missing, damaged, not a Fleet file, or lacks a key
            ``state`` names.
    """
    saved = load_checkpoint(path)  # checksum, then torch.load(weights_only=True)
    if FLEET_KEY not in saved:
        raise CheckpointError(f"{path} was not written by Fleet.save (no {FLEET_KEY!r} "
                              "entry). Load a gpufleet train checkpoint with "
                              "gpufleet.load_checkpoint(path, model, optimizer) instead.")
    missing = [k for k in state if k not in saved]
    if missing:
        held = sorted(k for k in saved if k not in (FLEET_KEY, "format"))
        raise CheckpointError(f"{path} holds no {', '.join(map(repr, missing))}; it holds "
                              f"{', '.join(held)}. Load with the keys it was saved with.")
    for key, value in state.items():
        if isinstance(value, nn.Module):
            value.load_state_dict(saved[key])
        elif _has_state(value):
            value.load_state_dict(saved[key])
        else:
            state[key] = saved[key]
    rngs = saved[FLEET_KEY]["rng"]
    if len(rngs) == world_size:
        set_rng_state(rngs[rank])
    else:
        log.warning("%s was saved by %d rank(s), this run has %d: random states start "
                    "afresh (the data position resumes exactly)", path, len(rngs), world_size)
    skip = {FLEET_KEY, "format", *state}
    return {k: v for k, v in saved.items() if k not in skip}
