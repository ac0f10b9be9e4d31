"""``Fleet.save`` and ``Fleet.load``: your state dict of models, optimizers, loaders and
plain values, written atomically with a checksum and read with ``weights_only=True``.

What goes in a file: each model's own state dict (no ``module.`` prefix), each
optimizer's and scheduler's state dict, each set-up loader's position, your plain values
as they are, and every rank's RNG states (so dropout and your own random draws continue
exactly). Rank 0 writes through :func:`~gpufleet.train.checkpoint.format.write_checkpoint_file`
(a temporary name, fsync, rename, a ``.sha256`` beside it); every rank reads through
:func:`~gpufleet.train.checkpoint.format.load_checkpoint` (the checksum checked, nothing in the
file can run code).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gpufleet.core.phases import Phase
from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.fleet.run import FleetPart
from gpufleet.fleet.wrappers import FleetModule
from gpufleet.launch import barrier, gather_objects
from gpufleet.train.checkpoint.files import FORMAT_VERSION
from gpufleet.train.checkpoint.format import load_checkpoint, write_checkpoint_file
from gpufleet.train.seed import rng_state, set_rng_state

log = logging.getLogger(__name__)

#: The key under which a Fleet file keeps what it adds (every rank's RNG states).
FLEET_KEY = "_fleet"
#: the entries a file keeps for itself beside your state (its RNG states, its format)
_OWN_KEYS = (FLEET_KEY, "format")


class FleetCheckpoints(FleetPart):
    """``save`` and ``load`` of :class:`~gpufleet.fleet.Fleet` (a part of it), in
    Fabric's call forms."""

    def save(self, path: str | Path, state: dict[str, Any],
             filter: dict[str, Callable[[str, Any], bool]] | None = None) -> Path:
        """Save ``state`` (models, optimizers, schedulers, set-up loaders, plain values)
        to ``path``: rank 0 writes it atomically with a checksum, with every rank's RNG
        states and each loader's exact position. ``filter`` (Fabric's): for a state
        key, a function ``(name, value) -> bool`` choosing the items of its state dict
        to save (a model's trainable weights only). COLLECTIVE: call it on every rank."""
        run = self._rank_run()
        with run.phases(Phase.CHECKPOINT):
            return save_state(path, state, run.strategy, run.env.rank, filter)

    def load(self, path: str | Path, state: dict[str, Any] | None = None,
             strict: bool = True, *, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore what :meth:`save` wrote into ``state`` (in place: objects load their
        state dicts, plain values are replaced; this rank's RNG states too). Returns
        what the file holds beyond ``state``'s keys; without ``state``, all your loop
        saved (nothing restored), as Fabric returns the whole checkpoint.
        ``strict=False``: keys the file lacks and a model's missing or unexpected names
        are skipped, and a warning names them. The file is always read with
        ``weights_only=True`` (nothing in it can run code); ``weights_only=False`` is
        refused."""
        _refuse_unsafe_load("load", weights_only)
        run = self._rank_run()
        return load_state(path, state, run.strategy, run.env.rank, run.env.world_size,
                          strict=strict)

    def load_raw(self, path: str | Path, obj: nn.Module | Optimizer, strict: bool = True,
                 *, weights_only: bool | None = None) -> None:
        """Load a plain PyTorch file, ``torch.save(model.state_dict(), path)`` (or an
        optimizer's), into ``obj``, a model or optimizer set up or not, as Fabric's
        ``load_raw``: ``obj.load_state_dict(torch.load(path))`` (under fsdp or tensor
        parallel, call it before :meth:`setup`: the set-up model is sharded), read with
        ``weights_only=True`` (nothing in the file can run code; ``False`` is refused as
        in :meth:`load`). ``strict=False`` (a model): missing and unexpected names are
        skipped, and a warning names them. Every rank reads the file."""
        _refuse_unsafe_load("load_raw", weights_only)
        load_raw_state(path, obj, strict)


def _refuse_unsafe_load(call: str, weights_only: bool | None) -> None:
    if weights_only is not None and not weights_only:
        raise ConfigError(
            f"{call}(weights_only=False): gpufleet reads every file with "
            "weights_only=True, so that nothing in a file can run code when it is "
            "loaded. State dicts, tensors and plain values load so; drop "
            "weights_only=False (or pass True). For a file of pickled objects you "
            "trust, call torch.load(path, weights_only=False) yourself.")


def load_raw_state(path: str | Path, obj: Any, strict: bool = True) -> None:
    """``obj.load_state_dict(torch.load(path, weights_only=True))`` for a model (strict
    or not, what was skipped logged) or an optimizer.

    Raises:
        CheckpointError: the file is missing, cannot be read as a state dict, or does
            not fit ``obj`` (the names or shapes it holds).
        ConfigError: ``obj`` is neither a model nor an optimizer, or it is sharded
            (its parameters DTensors: load before setup instead).
    """
    if not isinstance(obj, (nn.Module, Optimizer)):
        raise ConfigError(f"load_raw: {type(obj).__name__} is neither a model nor an "
                          "optimizer; load a dict of several with fleet.load(path, state).")
    tensors = obj.parameters() if isinstance(obj, nn.Module) else \
        (p for group in obj.param_groups for p in group["params"])
    if any(hasattr(t, "to_local") for t in tensors):  # DTensors: fsdp, tensor parallel
        raise ConfigError(
            f"load_raw: this {type(obj).__name__} is sharded (fsdp or tensor parallel), "
            "and a plain state dict holds whole tensors. Call fleet.load_raw(path, model) "
            "before fleet.setup, on the model you built (under init_module too), and "
            "build the optimizer after setup.")
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"load_raw: {path} does not exist (or is not a file).")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file, or objects weights_only refuses
        raise CheckpointError(
            f"load_raw: {path} could not be read as a state dict ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:300]}). It must be a file torch.save wrote of a "
            "state dict; the file was not changed.") from e
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"load_raw: {path} holds a {type(saved).__name__}, not a "
                              "state dict (torch.save(model.state_dict(), path) writes one).")
    try:
        if isinstance(obj, Optimizer):
            obj.load_state_dict(dict(saved))  # torch copies it first anyway
            return
        result = obj.load_state_dict(saved, strict=strict)
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"load_raw: {path} does not fit this "
                              f"{type(obj).__name__}: {e}") from e
    skipped = _skipped_names("model", result)
    if skipped:
        log.warning("%s loaded with strict=False; skipped: %s", path, "; ".join(skipped))


def _has_state(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


def saveable(state: Mapping[str, Any], strategy: Any,
             filter: Mapping[str, Callable[[str, Any], bool]] | None = None
             ) -> dict[str, Any]:
    """``state`` with every stateful object replaced by its state dict; for a key of
    ``filter``, only the items of its (dict) value that ``filter[key](name, value)``
    keeps (Fabric's ``save(filter=)``: a key none of whose items is kept is left out)."""
    _check_filter(filter, state)
    reserved = [k for k in state if k in _OWN_KEYS]
    if reserved:  # the file's own entries: the RNG states and the format number
        raise ConfigError(f"Fleet.save: the state key {reserved[0]!r} is the file's own "
                          "(Fleet keeps its format and RNG states there); save that value "
                          "under another name.")
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
        if filter and key in filter and isinstance(out[key], Mapping):
            kept = {k: v for k, v in out.pop(key).items() if filter[key](k, v)}
            if kept:
                out[key] = kept
    return out


def _check_filter(filter: Any, state: Mapping[str, Any]) -> None:
    """Fabric's checks of ``save(filter=)``, as gpufleet errors."""
    if filter is None:
        return
    if not isinstance(filter, Mapping):
        raise ConfigError(f"save(filter={filter!r}): give a dict of state key to a "
                          "function (name, value) -> bool that keeps an item.")
    unknown = [k for k in filter if k not in state]
    if unknown:
        raise ConfigError(f"save(filter=...) names {', '.join(map(repr, unknown))}, not "
                          f"keys of the state ({', '.join(map(repr, state))}).")
    for key, keep in filter.items():
        if not callable(keep):
            raise ConfigError(f"save(filter=...)[{key!r}] is {type(keep).__name__}: give "
                              "a function (name, value) -> bool.")


def save_state(path: str | Path, state: Mapping[str, Any], strategy: Any,
               rank: int, filter: Mapping[str, Any] | None = None) -> Path:
    """Write ``state`` to ``path`` (COLLECTIVE: every rank calls it; rank 0 writes), its
    items kept by ``filter`` (see :func:`saveable`).

    Raises:
        OSError: the write failed; nothing is left under ``path``'s name and an older
            file there is untouched.
    """
    path = Path(path)
    content = saveable(state, strategy, filter)
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


def load_state(path: str | Path, state: dict[str, Any] | None, strategy: Any,
               rank: int, world_size: int, strict: bool = True) -> dict[str, Any]:
    """Restore ``path`` into ``state`` in place: objects load their state dicts, plain
    values are replaced, and this rank's RNG states are restored. Returns what the file
    holds that ``state`` did not ask for; without ``state`` (None or empty), everything
    your loop saved in it, and nothing is restored (the RNG states neither).

    ``strict=False`` (Fabric's): a key of ``state`` the file lacks is left as it is, and
    a model loads its state dict non-strictly (missing and unexpected names skipped); a
    warning names what was skipped.

    Raises:
        CheckpointError: the file is missing, damaged, not a Fleet file, or (strict)
            lacks a key ``state`` names.
    """
    saved = load_checkpoint(path)  # checksum, then torch.load(weights_only=True)
    if FLEET_KEY not in saved:
        raise CheckpointError(f"{path} was not written by Fleet.save (no {FLEET_KEY!r} "
                              "entry). Load a gpufleet train checkpoint with "
                              "gpufleet.load_checkpoint(path, model, optimizer) instead.")
    rest = {k: v for k, v in saved.items() if k not in _OWN_KEYS}
    if not state:
        return rest
    missing = [k for k in state if k not in saved]
    if missing and strict:
        raise CheckpointError(f"{path} holds no {', '.join(map(repr, missing))}; it holds "
                              f"{', '.join(sorted(rest))}. Load with the keys it was saved "
                              "with, or pass strict=False to leave those as they are.")
    skipped = [f"{key!r} (not in the file)" for key in missing]
    for key, value in state.items():
        if key in missing:
            continue
        if isinstance(value, nn.Module):
            result = value.load_state_dict(rest.pop(key), strict=strict)
            skipped += _skipped_names(key, result)
        elif _has_state(value):
            value.load_state_dict(rest.pop(key))
        else:
            state[key] = rest.pop(key)
    if skipped:
        log.warning("%s loaded with strict=False; skipped: %s", path, "; ".join(skipped))
    rngs = saved[FLEET_KEY]["rng"]
    if len(rngs) == world_size:
        set_rng_state(rngs[rank])
    else:
        log.warning("%s was saved by %d rank(s), this run has %d: random states start "
                    "afresh (the data position resumes exactly)", path, len(rngs), world_size)
    return rest


def _skipped_names(key: str, result: Any) -> list[str]:
    """What a non-strict ``load_state_dict`` of the model under ``key`` left out."""
    out = []
    for kind in ("missing_keys", "unexpected_keys"):
        names = getattr(result, kind, None) or []
        if names:
            out.append(f"{key!r} {kind.replace('_', ' ')} {', '.join(names)}")
    return out
