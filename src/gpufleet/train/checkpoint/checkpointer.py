"""Checkpointing as a component: the full training state written and read back.

Rank 0 writes a single file (``train/checkpoint/format.py``); sharded strategies (fsdp) write a
directory, every rank its shards and rank 0 the rest (``train/checkpoint/sharded.py``). Every
rank's RNG states and the sampler's position go in, so a resumed run continues the
uninterrupted one exactly.

With ``checkpoint.async_save`` the checkpoint is written in the background
(:mod:`gpufleet.train.checkpoint.async_writer`): the training thread only copies the state into host
memory (a sharded run: every rank its shards, then every rank's thread writes them).
Every save logs how long it blocked training and how long the write took.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.config import Config, config_to_dict
from gpufleet.errors import CheckpointError
from gpufleet.fault.snapshot import optimizer_storages
from gpufleet.launch import DistEnv, broadcast_object, gather_objects
from gpufleet.train.checkpoint import format as ckpt
from gpufleet.train.checkpoint import sharded as sharded_ckpt
from gpufleet.train.checkpoint.async_writer import BackgroundSaves, log_saved
from gpufleet.train.checkpoint.keeping import BestCheckpoints
from gpufleet.train.seed import rng_state, set_rng_state

log = logging.getLogger(__name__)


@dataclass
class Position:
    """Where training is: optimizer steps done, the epoch, and what of it was consumed
    (samples, or batches with token budgets)."""

    step: int
    epoch: int
    consumed: int


class Checkpointer:
    """Saves and restores a run's state; built once per run, after the components.

    Args:
        run_dir / env / cfg: the run's directory, this rank, the config saved along.
        model / optimizer / scheduler / strategy / precision: what is saved.
        sampler: the training sampler (its position is saved).
        parts: several models (:class:`~gpufleet.train.engine.run.ModelPart`), each saved with
            its optimizer, scheduler and loss scaler under ``"models"`` by name; empty
            or one: the fields above, at the top level.
    """

    def __init__(self, run_dir: Path, env: DistEnv, cfg: Config, model: Any, optimizer: Any,
                 scheduler: Any, strategy: Any, precision: Any, sampler: Any,
                 parts: Sequence[Any] = ()) -> None:
        self.run_dir, self.env, self.cfg = run_dir, env, cfg
        self.parts = list(parts) if len(parts) > 1 else []
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.strategy, self.precision, self.sampler = strategy, precision, sampler
        keeping = cfg.checkpoint
        self.best = (BestCheckpoints(run_dir, keeping.keep_best, keeping.mode)
                     if keeping.keep_best else None)
        sharded = strategy.saves_on_every_rank
        # The writer thread exists where files are written: rank 0, or every rank of a
        # sharded run. A sharded write's collectives run over a group of its own (gloo:
        # the shards are in host memory by then), never between the step's collectives.
        self.saves = (BackgroundSaves() if keeping.async_save and (env.is_main or sharded)
                      else None)
        self._group = writers_group() if keeping.async_save and sharded else None
        self.async_save = keeping.async_save
        self._written: Path | None = None  # the newest checkpoint saved synchronously
        #: the world size the state restored last was written at (None: not recorded)
        self.restored_world: int | None = None

    def regroup(self) -> None:
        """The process group was made again (in-process recovery): a sharded run's
        background writes get a group over it (COLLECTIVE where they have one)."""
        if self.async_save and self.strategy.saves_on_every_rank:  # as at the start
            self._group = writers_group()

    def save(self, at: Position, last_good: str | None,
             score: float | None = None) -> tuple[Path | None, str | None]:
        """Write the state at ``at`` (COLLECTIVE: every rank calls it).

        A failed write (a full disk, a lost mount) is reported, not raised: nothing is
        left under the new checkpoint's name and the older ones stay intact.

        Returns:
            ``(path, None)``, or ``(None, error)`` on every rank when the write failed.
        """
        start = time.perf_counter()
        rngs = gather_objects(rng_state())  # COLLECTIVE: every rank's RNG states
        sharded = self.strategy.saves_on_every_rank  # fsdp: a directory, a shard per rank
        path = (sharded_ckpt.sharded_checkpoint_path if sharded else ckpt.checkpoint_path)(
            self.run_dir, at.step)
        # COLLECTIVE for some strategies (zero1 gathers the optimizer state on rank 0;
        # fsdp returns each rank's shards): every rank calls it.
        model_state = self._models_state()
        error, state = None, None
        if self.env.is_main:
            state = {**self._trainer_state(at, rngs), "config": config_to_dict(self.cfg)}
        keep: set[int] = set()
        if sharded or self.env.is_main:
            try:
                if self.best is not None and self.env.is_main:  # the best k outlive
                    self.best.record(at.step, score)            # keep_last
                    keep = self.best.keep()
                content = (model_state, state) if sharded else {**model_state, **(state or {})}
                save = self._saver(sharded, at.step, keep)
                if self.saves is not None:  # a sharded run: on every rank
                    self.saves.submit(at.step, path, content, save, start,
                                      self.env.is_main)
                else:
                    save(content)
            except OSError as e:
                error = (f"checkpoint {path.name} could not be written: {e}. Training goes "
                         f"on; the last good checkpoint is {last_good or 'none'}."
                         " Free space in (or fix) the run directory's file system.")
        # COLLECTIVE: every rank learns whether rank 0's write succeeded (a few bytes).
        error = broadcast_object(error)
        if error is not None:
            if self.env.is_main:
                log.error("%s", error)
            return None, error
        if self.env.is_main and self.saves is None:
            log_saved(path, at.step, time.perf_counter() - start, None)
        if self.saves is None:
            self._written = path
        return path, None

    @property
    def written(self) -> Path | None:
        """The newest checkpoint complete on disk (as this rank knows it)."""
        return self.saves.written if self.saves is not None else self._written

    def _saver(self, sharded: bool, step: int, keep: set[int]) -> Callable[[Any], Any]:
        """How the content of the checkpoint at ``step`` is written: ``(shards, rest)``
        as a sharded directory (COLLECTIVE: every rank its shards, rank 0 the rest; in
        the background over the writers' own group), or one dict as a single file."""
        keep_last, group = self.cfg.checkpoint.keep_last, self._group
        if sharded:
            return lambda s: sharded_ckpt.save_sharded_checkpoint(
                self.run_dir, step, s[0], s[1], keep_last, keep, group=group)
        return lambda s: ckpt.save_checkpoint(self.run_dir, step, s, keep_last, keep)

    def wait(self) -> None:
        """Wait for the background write in flight, if any (this rank only)."""
        if self.saves is not None:
            self.saves.collect()

    def finish(self, result: Any) -> None:
        """At the end of a run (also after a preemption signal): wait for the background
        write, then give every rank's ``result`` the background writes that failed and
        the newest checkpoint complete on disk (COLLECTIVE with ``async_save``)."""
        if not self.async_save:
            return
        failed: list[str] = []
        if self.saves is not None:
            self.saves.collect()
            failed, self.saves.errors = self.saves.errors, []
        # COLLECTIVE: every rank learns rank 0's failed writes and newest checkpoint.
        errors, written = broadcast_object((failed, self.written))
        result.checkpoint_errors.extend(errors)
        result.checkpoint = str(written) if written is not None else None

    def load(self, path: Path) -> Position:
        """Restore model, optimizer, scheduler, scaler, data position and RNG; returns
        where the checkpoint was written."""
        # Rank 0 checked the checksum when it chose this file (plan_run): no rank
        # hashes it again.
        sharded = path.is_dir()  # written by a sharded strategy (fsdp) at any world size
        state = sharded_ckpt.read_trainer_state(path) if sharded else ckpt.load_checkpoint(
            path, verify=False)
        return self.restore(state, f"checkpoint {path}", path if sharded else None)

    def restore(self, state: dict[str, Any], source: str,
                shards: Path | None = None) -> Position:
        """Restore model, optimizer, scheduler, scaler, data position and RNG from
        ``state``: a checkpoint's content, or what :meth:`rank_state` returned (an
        in-memory snapshot; the same keys). ``source`` names it in messages; ``shards``
        is a sharded checkpoint's directory, whose shards each rank reads here."""
        try:
            if shards is not None:  # COLLECTIVE: each rank reads what makes up its shards
                sharded_ckpt.load_sharded_into(
                    shards, self.model, self.optimizer,
                    consolidates_optimizer=self.strategy.traits.consolidates_optimizer)
            elif self.parts:
                self._load_models(state)
            else:
                self.strategy.load_state_dict(self.model, self.optimizer, state)
            if not self.parts:
                self.scheduler.load_state_dict(state["scheduler"])
                self.precision.load_state_dict(state["precision"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"{source} does not fit this run: {e}. It was written by "
                "a different model, optimizer or config; resume with the config saved in "
                "its run directory (config.toml), or start a new run."
            ) from e
        at = Position(state["step"], state["epoch"], 0)
        at.consumed = self._restore_position(source, state, at.epoch)
        self.restored_world = state.get("world_size")
        if self.env.is_main:
            log.info("resumed from %s at step %d", source.removeprefix("checkpoint "),
                     at.step)
        return at

    def _trainer_state(self, at: Position, rng: Any) -> dict[str, Any]:
        """What a checkpoint holds besides the models: scheduler and scaler (of the one
        model), step, epoch, the sampler's position, ``rng`` and the world size."""
        return {
            **({} if self.parts else {"scheduler": self.scheduler.state_dict(),
                                      "precision": self.precision.state_dict()}),
            "step": at.step, "epoch": at.epoch,
            "sampler": self.sampler.state_dict(at.consumed),
            "rng": rng, "world_size": self.env.world_size,
        }

    def _models_state(self, local: bool = False) -> dict[str, Any]:
        """The model and optimizer state (COLLECTIVE for some strategies, unless
        ``local``: then what lives on this rank, see ``Strategy.local_state_dict``);
        with several models, each one's with its scheduler and scaler under
        ``"models"``."""
        get = self.strategy.local_state_dict if local else self.strategy.state_dict
        if not self.parts:
            return get(self.model, self.optimizer)
        return {"models": {
            part.name: {**get(part.model, part.optimizer),
                        "scheduler": part.scheduler.state_dict(),
                        "precision": part.precision.state_dict()}
            for part in self.parts}}

    def rank_state(self, at: Position) -> dict[str, Any]:
        """This rank's whole training state at ``at``, from this rank alone (no
        collective): the model and optimizer state as they live here (shards under fsdp,
        this rank's part of the optimizer under zero1), scheduler, scaler, the data
        position and this rank's RNG states. The tensors are the live ones, not copies
        (an in-memory snapshot copies them)."""
        return {**self._models_state(local=True), **self._trainer_state(at, rng_state()),
                "rank": self.env.rank}

    def optimizer_storages(self) -> set[int]:
        """The storages (data pointers) of the parameters and of the optimizer state:
        what only an optimizer step changes, so a snapshot may copy it while the next
        step's forward and backward run."""
        models = [(p.model, p.optimizer) for p in self.parts] or [(self.model,
                                                                  self.optimizer)]
        # (zero1: the optimizer's inner state is this rank's part)
        return optimizer_storages([m for m, _ in models], [o for _, o in models])

    def _load_models(self, state: dict[str, Any]) -> None:
        """Restore every model of a run of several from its entry under ``"models"``."""
        saved = state["models"]
        names = [part.name for part in self.parts]
        if sorted(saved) != sorted(names):
            raise KeyError(f"the checkpoint holds the models {sorted(saved)}, this run "
                           f"trains {sorted(names)}")
        for part in self.parts:
            own = saved[part.name]
            self.strategy.load_state_dict(part.model, part.optimizer, own)
            part.scheduler.load_state_dict(own["scheduler"])
            part.precision.load_state_dict(own["precision"])

    def _restore_position(self, source: str, state: dict[str, Any], epoch: int) -> int:
        """Put the sampler (and, at the same world size, the RNG) where the checkpoint
        left them; returns what of the epoch was consumed."""
        saved_world = state.get("world_size", 1)
        # A global position ("samples") resumes at any world size: the rest of the epoch
        # is split over this run's ranks, so every sample is still read once.
        portable = "samples" in state["sampler"]
        if portable or saved_world == self.env.world_size:
            try:
                self.sampler.load_state_dict(state["sampler"])
            except ValueError as e:
                raise CheckpointError(f"{source}: the training data does "
                                      f"not match the run that wrote it ({e}).") from e
            if saved_world == self.env.world_size:
                set_rng_state(state["rng"][self.env.rank])
            elif self.env.is_main:
                log.info("%s was written by %d rank(s), this run has %d: the "
                         "rest of epoch %d (after %d samples) is split over them", source,
                         saved_world, self.env.world_size, epoch,
                         state["sampler"]["samples"])
            return self.sampler.position
        # A different rank count splits the data differently: restart the epoch.
        self.sampler.set_epoch(epoch)
        log.warning("%s was written by %d rank(s), this run has %d: the data "
                    "position restarts at the beginning of epoch %d", source, saved_world,
                    self.env.world_size, epoch)
        return 0


def writers_group() -> Any:
    """A gloo process group of every rank for background sharded writes (None alone)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")  # COLLECTIVE: every rank, once, in one order
