"""``Fleet.save`` and ``Fleet.load``: your state dict of models, optimizers, loaders and
plain values, written atomically with a checksum and read with ``weights_only=True``.

What goes in: each model's own state dict (no ``module.`` prefix), each optimizer's and
scheduler's state dict, each set-up loader's position, your plain values as they are
(one per rank where they differ between ranks: :mod:`~gpufleet.fleet.perrank`), and
every rank's RNG states (so dropout and your own random draws continue exactly). Where
every rank holds the whole model (``single``, ``ddp``, ``zero1``: its optimizer state
gathered on rank 0 first), rank 0 writes one file through
:func:`~gpufleet.train.checkpoint.format.write_checkpoint_file` (a temporary name,
fsync, rename, a ``.sha256`` beside it) and every rank reads it through
:func:`~gpufleet.train.checkpoint.format.load_checkpoint` (the checksum checked,
nothing in the file can run code). Where the ranks hold shards (``fsdp``, ``hsdp``,
tensor parallel) the path is a directory of shards (:mod:`~gpufleet.fleet.sharded`).
With ``checkpoint.async_save`` both are written in the background, as ``fit``'s are.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gpufleet.core.phases import Phase
from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.fleet.loader import FleetLoader
from gpufleet.fleet.part import FleetPart
from gpufleet.fleet.perrank import differing, gather_per_rank
from gpufleet.fleet.sharded import (
    is_sharded_checkpoint,
    load_entries,
    load_whole,
    shard_entries,
    verify,
)
from gpufleet.fleet.stages import holds_stages, load_stage_entries, stage_entries
from gpufleet.fleet.steps import StepTracker
from gpufleet.fleet.wrappers import FleetModule, unwrap_optimizer
from gpufleet.fleet.writes import write_directory, write_file
from gpufleet.launch import broadcast_object, gather_objects
from gpufleet.train.checkpoint.async_writer import BackgroundSaves
from gpufleet.train.checkpoint.checkpointer import writers_group
from gpufleet.train.checkpoint.files import FORMAT_VERSION
from gpufleet.train.checkpoint.format import load_checkpoint
from gpufleet.train.checkpoint.sharded import read_trainer_state
from gpufleet.train.seed import rng_state, set_rng_state

log = logging.getLogger(__name__)

#: The key under which a Fleet file keeps what it adds (every rank's RNG states).
FLEET_KEY = "_fleet"
#: the entries a file keeps for itself beside your state (its RNG states, its format)
_OWN_KEYS = (FLEET_KEY, "format")


class FleetCheckpoints(FleetPart):
    """``save`` and ``load`` of :class:`~gpufleet.fleet.Fleet` (a part of it), in
    Fabric's call forms."""

    _placed: list[nn.Module]  # every model set up, as placed
    _steps: StepTracker
    _saves: BackgroundSaves | None = None  # checkpoint.async_save: the writes under way
    _writers: Any = None  # their process group (sharded writes), made at the first save
    _last_saved: dict[str, Any] | None = None  # the state handed to the last save

    def save(self, path: str | Path, state: dict[str, Any],
             filter: dict[str, Callable[[str, Any], bool]] | None = None) -> Path:
        """Save ``state`` (models, optimizers, schedulers, set-up loaders, plain values)
        to ``path``, atomically with checksums, with every rank's RNG states, each
        loader's exact position and, for a plain value that differs between ranks,
        every rank's own. Rank 0 writes one file; under ``fsdp``, ``hsdp`` or tensor
        parallel ``path`` is a directory, every rank writing its shards. With
        ``checkpoint.async_save`` the write goes on in the background (``save``
        returns once the state is copied to host memory; the next ``save``, ``load``
        and ``finish`` wait for it, and a failed one is raised at the next ``save`` or
        ``load``). ``filter`` (Fabric's): for a state key, a function ``(name, value) ->
        bool`` choosing the items of its state dict to save (a model's trainable weights
        only). COLLECTIVE: call it on every rank.

        Raises:
            OSError: the write (or the background write before it) failed; an older
                checkpoint at ``path`` is untouched.
        """
        run = self._rank_run()
        self._last_saved = state  # what a preemption saves, where none is registered
        with run.phases(Phase.CHECKPOINT), self._guard:  # a lost node: recovered
            self._raise_failed_save()
            background = None
            if run.cfg.checkpoint.async_save:
                self._saves = self._saves or BackgroundSaves()
                if run.strategy.saves_on_every_rank and self._writers is None:
                    self._writers = writers_group()  # COLLECTIVE, once
                background = (self._saves, self._writers)
            with self._no_step_counted():
                return save_state(path, state, run.strategy, run.env.rank, filter,
                                  placed=self._placed, background=background,
                                  step=run.state.step)

    def load(self, path: str | Path, state: dict[str, Any] | None = None,
             strict: bool = True, *, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore what :meth:`save` wrote into ``state`` (in place: objects load their
        state dicts, plain values are replaced, a value saved per rank by its own rank;
        this rank's RNG states too). Returns what the file holds beyond ``state``'s
        keys; without ``state``, all your loop saved (nothing restored), as Fabric
        returns the whole checkpoint. A sharded directory loads at another world size
        (its shards are read as this run splits them); a value saved per rank does not
        (it is refused, naming the key; ``strict=False`` leaves it as it is).
        ``strict=False``: keys the file lacks and a model's missing or unexpected names
        are skipped, and a warning names them. The file is always read with
        ``weights_only=True`` (nothing in it can run code); ``weights_only=False`` is
        refused. COLLECTIVE for a sharded directory, and with ``checkpoint.async_save``.

        Raises:
            CheckpointError: the checkpoint is missing, damaged (a checksum differs), not
                a Fleet checkpoint, lacks a key ``state`` names (strict), or does not fit.
        """
        _refuse_unsafe_load("load", weights_only)
        run = self._rank_run()
        self._raise_failed_save()
        with self._no_step_counted():
            return load_state(path, state, run.strategy, run.env.rank, run.env.world_size,
                              strict=strict, placed=self._placed,
                              on_step=self._steps.resumed)

    def _raise_failed_save(self) -> None:
        """Wait for the background write under way; raise its failure on every rank
        (COLLECTIVE with ``checkpoint.async_save``)."""
        error = self._wait_for_saves(collective=True)
        if error is not None:
            raise OSError(error)

    def _wait_for_saves(self, collective: bool) -> str | None:
        """Wait for the background write under way (if any); returns the message of a
        failed one, on every rank when ``collective`` (rank 0's: a single file is
        written there, and a sharded write's failure is every rank's)."""
        run = self._rank_run()
        if not run.cfg.checkpoint.async_save:
            return None
        error = self._saves.collect() if self._saves is not None else None
        if collective:
            error = broadcast_object(error)  # COLLECTIVE: a few bytes
        if error is not None:
            run.result.checkpoint_errors.append(error)
        return error

    @contextlib.contextmanager
    def _no_step_counted(self) -> Iterator[None]:
        """A step torch itself takes on an optimizer in here (DCP creates a fresh
        optimizer's state with one step at learning rate 0) is not your loop's."""
        steps = getattr(self, "_steps", None)
        if steps is None:
            yield
            return
        busy, steps.busy = steps.busy, True
        try:
            yield
        finally:
            steps.busy = busy

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
             filter: Mapping[str, Callable[[str, Any], bool]] | None = None,
             rank: int = 0) -> dict[str, Any]:
    """``state`` with every stateful object replaced by its state dict; for a key of
    ``filter``, only the items of its (dict) value that ``filter[key](name, value)``
    keeps (Fabric's ``save(filter=)``: a key none of whose items is kept is left out).
    A zero1 optimizer's state is gathered on rank 0 (COLLECTIVE: every rank calls it;
    ``rank``: this one), where the file is written."""
    check_keys(state, filter)
    out: dict[str, Any] = {}
    for key, value in state.items():
        inner = unwrap_optimizer(value)
        if isinstance(value, nn.Module):
            # A FleetModule's is your module's own; a module you placed yourself unwraps.
            out[key] = value.state_dict() if isinstance(value, FleetModule) \
                else strategy.unwrap(value).state_dict()
        elif callable(getattr(inner, "consolidate_state_dict", None)):
            # zero1: each rank holds a part of the optimizer state; rank 0 gets it whole
            inner.consolidate_state_dict(to=0)  # COLLECTIVE: each rank sends its part
            out[key] = inner.state_dict() if rank == 0 else {}
        elif _has_state(value):  # optimizers, schedulers, Fleet loaders, scalers
            out[key] = value.state_dict()
        else:
            out[key] = value
        if filter and key in filter and isinstance(out[key], Mapping):
            kept = {k: v for k, v in out.pop(key).items() if filter[key](k, v)}
            if kept:
                out[key] = kept
    return out


def check_keys(state: Mapping[str, Any],
               filter: Mapping[str, Callable[[str, Any], bool]] | None) -> None:
    """Refuse the file's own keys in ``state`` and a ``filter`` that does not fit it."""
    _check_filter(filter, state)
    reserved = [k for k in state if k in _OWN_KEYS]
    if reserved:  # the file's own entries: the RNG states and the format number
        raise ConfigError(f"Fleet.save: the state key {reserved[0]!r} is the file's own "
                          "(Fleet keeps its format and RNG states there); save that value "
                          "under another name.")


def plain_entries(state: Mapping[str, Any], content: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``content`` compared between the ranks (and copied whole into an
    in-memory snapshot): your plain values in ``state`` (not models, optimizers or
    objects with a state dict), and the set-up loaders' positions (the same on ranks in
    step; a loader of your own that keeps its state, or a rank that read ahead, differs,
    and is then kept per rank)."""
    return {k: v for k, v in content.items()
            if isinstance(state[k], FleetLoader)
            or (not isinstance(state[k], nn.Module) and not _has_state(state[k]))}


def _check_filter(filter: Any, state: Mapping[str, Any]) -> None:
    """Fabric's checks of ``save(filter=)``, of its types and in its words (a Fabric
    loop's tests match them), each naming the fix."""
    if filter is None:
        return
    if not isinstance(filter, Mapping):
        raise TypeError(f"save(filter=...): the filter should be a dict, given {filter!r}: "
                        "give a dict of state key to a function (name, value) -> bool that "
                        "keeps an item.")
    unknown = set(filter) - set(state)
    if unknown:
        raise ConfigError(f"save(filter=...): the filter keys {unknown} are not present in "
                          f"the state keys {set(state)}: name keys of the state.")
    for key, keep in filter.items():
        if not callable(keep):
            raise TypeError(f"save(filter=...) for key {key!r} should be a callable, given "
                            f"{keep!r}: give a function (name, value) -> bool.")


def save_state(path: str | Path, state: Mapping[str, Any], strategy: Any,
               rank: int, filter: Mapping[str, Any] | None = None, *,
               placed: Sequence[nn.Module] = (),
               background: tuple[BackgroundSaves, Any] | None = None,
               step: int = 0) -> Path:
    """Write ``state`` to ``path`` (COLLECTIVE: every rank calls it), its items kept by
    ``filter`` (see :func:`saveable`): one file from rank 0, or under a sharded strategy
    a directory of every rank's shards (``placed``: the set-up models, which an
    optimizer's state is named by). ``background``: the saver and (for a sharded write)
    its process group, to write in the background as ``fit`` does. ``step``: the
    optimizer steps done (``fleet.step``), which :func:`load_state` restores.

    Raises:
        OSError: the write failed; nothing is left under ``path``'s name and an older
            checkpoint there is untouched.
    """
    start = time.perf_counter()
    path = Path(path)
    check_keys(state, filter)
    sharded = strategy.saves_on_every_rank
    # COLLECTIVE under fsdp and tp (the shards' metadata) and zero1 (its gather)
    shards = shard_entries(state, strategy, placed, filter) if sharded else {}
    # COLLECTIVE under pipeline: every stage's state gathered into the whole model's
    stages = stage_entries(state, strategy) if holds_stages(strategy) else {}
    content = saveable({k: v for k, v in state.items() if k not in shards and k not in stages},
                       strategy, filter, rank)
    content.update(saveable(stages, strategy, filter and
                            {k: f for k, f in filter.items() if k in stages}, rank))
    plain = plain_entries(state, content)
    ranked = differing(plain)  # COLLECTIVE: a digest of each plain value, every rank
    if ranked:
        log.info("Fleet.save: %s differ between the ranks; each rank's is saved and goes "
                 "back to its own rank", ", ".join(map(repr, ranked)))
    per_rank = gather_per_rank(plain, ranked)  # COLLECTIVE: only those values
    own = {FLEET_KEY: {"rng": gather_objects(rng_state()),  # COLLECTIVE: every rank's
                       "per_rank": per_rank, "step": int(step)}}
    kept = {k: v for k, v in content.items() if k not in per_rank}
    if sharded:
        own[FLEET_KEY].update(state=kept, shards=sorted(shards))
        return write_directory(path, shards, own, background, start, rank)
    if path.is_dir():
        raise ConfigError(f"Fleet.save: {path} is a directory (a sharded checkpoint, "
                          f"saved under fsdp or tp); strategy {strategy.name!r} writes "
                          "one file. Save to another path.")
    return write_file(path, {"format": FORMAT_VERSION, **kept, **own}, background,
                      start, rank)


def load_state(path: str | Path, state: dict[str, Any] | None, strategy: Any,
               rank: int, world_size: int, strict: bool = True,
               placed: Sequence[nn.Module] = (),
               on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Restore ``path`` into ``state`` in place: objects load their state dicts, plain
    values are replaced (a value saved per rank by this rank's own), and this rank's
    RNG states are restored; ``on_step`` is handed the optimizer steps done when it was
    saved (``fleet.step``; a checkpoint from before steps were saved has none).
    Returns what the file holds that ``state`` did not ask for; without ``state`` (None
    or empty), everything your loop saved in it (a value saved per rank: this rank's,
    or at another world size the list of every saved rank's), and nothing is restored
    (the RNG states neither).

    ``strict=False`` (Fabric's): a key of ``state`` the file lacks is left as it is, and
    a model loads its state dict non-strictly (missing and unexpected names skipped); a
    warning names what was skipped. A sharded directory (``fsdp``, ``tp``) is read
    by every rank, its shards as this run splits them (COLLECTIVE).

    Raises:
        CheckpointError: the checkpoint is missing, damaged, not a Fleet checkpoint,
            (strict) lacks a key ``state`` names, or holds a value saved per rank and
            this run has another world size.
    """
    path = Path(path)
    sharded = is_sharded_checkpoint(path)
    if sharded:
        path = verify(path)  # COLLECTIVE: rank 0 checks every file's SHA-256
        saved = read_trainer_state(path)  # DCP's metadata checked, then weights_only
        own = saved.get(FLEET_KEY)
        rest = dict(own["state"]) if isinstance(own, dict) and "state" in own else None
    else:
        saved = load_checkpoint(path)  # checksum, then torch.load(weights_only=True)
        own = saved.get(FLEET_KEY)
        rest = {k: v for k, v in saved.items() if k not in _OWN_KEYS}
    if own is None or rest is None:
        raise CheckpointError(f"{path} was not written by Fleet.save (no {FLEET_KEY!r} "
                              "entry). Load a gpufleet train checkpoint with "
                              "gpufleet.load_checkpoint(path, model, optimizer) instead.")
    shards = list(own.get("shards", ()))
    per_rank = own.get("per_rank", {})
    same_world = len(own["rng"]) == world_size
    skipped: list[str] = []
    for key, values in per_rank.items():  # each rank's own, where it has one
        if same_world:
            rest[key] = values[rank]
        elif state and key in state:
            if strict:
                raise CheckpointError(_per_rank_refusal(path, key, len(values), world_size))
            skipped.append(f"{key!r} (saved per rank by {len(values)} ranks)")
        else:
            rest[key] = values
    if not state:  # (a sharded directory's models and optimizers load into objects)
        return rest
    names = set(rest) | set(shards) | set(per_rank)
    missing = [k for k in state if k not in names]
    if missing and strict:
        raise CheckpointError(f"{path} holds no {', '.join(map(repr, missing))}; it holds "
                              f"{', '.join(sorted(names))}. Load with the keys it was saved "
                              "with, or pass strict=False to leave those as they are.")
    skipped += [f"{key!r} (not in the file)" for key in missing]
    from_shards = [k for k in state if k in shards]
    if from_shards:  # COLLECTIVE: every rank reads what makes up its shards
        skipped += load_entries(path, state, from_shards, strategy, placed, strict)
    if holds_stages(strategy):  # this rank's stage of the whole model's state
        for key in load_stage_entries(state, rest, strategy):
            rest.pop(key)
    skipped += put_back(state, rest, strategy, placed, strict,
                        leave={*missing, *from_shards})
    if skipped:
        log.warning("%s loaded with strict=False; skipped: %s", path, "; ".join(skipped))
    if on_step is not None and "step" in own:
        on_step(int(own["step"]))
    rngs = own["rng"]
    if same_world:
        set_rng_state(rngs[rank])
    else:
        log.warning("%s was saved by %d rank(s), this run has %d: random states start "
                    "afresh (the data position resumes exactly)", path, len(rngs), world_size)
    return {k: v for k, v in rest.items() if k not in state}


def put_back(state: dict[str, Any], saved: dict[str, Any], strategy: Any,
             placed: Sequence[nn.Module] = (), strict: bool = True,
             leave: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Each of ``state``'s keys that ``saved`` holds (but those in ``leave``) back in
    place, taken out of ``saved``: models, optimizers, schedulers and loaders load their
    state dicts, plain values are replaced in ``state``. Returns what a non-strict load
    of a model skipped (see :func:`load_state`, and an in-memory snapshot's restore,
    :mod:`gpufleet.fleet.recovery`)."""
    skipped: list[str] = []
    for key, value in state.items():
        if key in leave or key not in saved:
            continue
        whole_model = isinstance(value, nn.Module) or \
            isinstance(unwrap_optimizer(value), Optimizer)
        if strategy.saves_on_every_rank and whole_model:  # a file into a sharded run
            skipped += load_whole(value, saved.pop(key), strategy, placed, key, strict)
        elif isinstance(value, nn.Module):
            result = value.load_state_dict(saved.pop(key), strict=strict)
            skipped += _skipped_names(key, result)
        elif _has_state(value):
            value.load_state_dict(saved.pop(key))
        else:
            state[key] = saved.pop(key)
    return skipped


def _per_rank_refusal(path: Path, key: str, saved: int, world_size: int) -> str:
    return (f"{path}: {key!r} differed between the {saved} ranks that saved it, and each "
            f"rank's value was kept for its own rank; this run has {world_size} rank(s), "
            f"so no rank's value is this rank's. Load at {saved} ranks, pass strict=False "
            f"to leave {key!r} as it is here (a warning names it), or save one value for "
            "every rank (the same on each).")


def _skipped_names(key: str, result: Any) -> list[str]:
    """What a non-strict ``load_state_dict`` of the model under ``key`` left out."""
    out = []
    for kind in ("missing_keys", "unexpected_keys"):
        names = getattr(result, kind, None) or []
        if names:
            out.append(f"{key!r} {kind.replace('_', ' ')} {', '.join(names)}")
    return out
