"""The training and evaluation DataLoaders of a run, built from the ``[data]`` section.

Two ways to batch the training set:

* ``data.batching = "fixed"``: ``data.batch_size`` samples per batch from a
  :class:`ResumableDistributedSampler`.
* ``data.batching = "tokens"``: variable-length samples packed under
  ``data.token_budget`` tokens per batch by a :class:`BucketBatchSampler`. The data set
  must expose ``lengths`` (one int per sample); batches are padded with
  :func:`pad_collate` unless the data set has its own ``collate_fn``.

Worker processes are seeded by :func:`seed_worker`; :func:`default_num_workers` picks
their number when the config leaves it to gpufleet. Every loader is a
:class:`ForkSafeLoader`: its workers never collect the garbage they inherit.

Either sampler resumes from the count the loop consumed (samples for "fixed", batches
for "tokens"), because a DataLoader prefetches and runs its sampler ahead of training.

A stream (an ``IterableDataset``) has no indices to sample: each rank reads its share
through a :class:`~gpufleet.data.stream_shard.StreamShard` (:func:`build_stream_loader`,
``data.batch_size`` items a batch, a short last row left out and logged), whose
position resumes the same way; :func:`stream_loader` is the loader over a share for
``fit`` and ``Fleet`` alike.
"""

from __future__ import annotations

import gc
import itertools
import logging
import random
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from gpufleet.config import Config, DataConfig
from gpufleet.data.bucket import BucketBatchSampler, pad_collate
from gpufleet.data.sampler import ResumableDistributedSampler
from gpufleet.data.stream_shard import StreamShard, check_source
from gpufleet.errors import ConfigError

log = logging.getLogger(__name__)

_FORKING = threading.Lock()


class ForkSafeLoader(DataLoader):
    """A ``DataLoader`` whose forked workers never run the finalizers of objects they
    inherited.

    A worker is forked with a copy of everything the parent held, its uncollected
    garbage too: an earlier run's loader iterator and the CUDA tensors the prefetcher
    kept. When the worker's garbage collector frees them, the iterator's finalizer
    shuts down workers that are not its children, and freeing a CUDA tensor in a forked
    process aborts it ("CUDA error: initialization error"; seen on an H200 with
    ``gpufleet.fit`` called four times in one process with 4 workers). So the parent's
    objects are frozen (``gc.freeze``: left out of every collection) while the workers
    are forked, as Python's documentation advises for fork without exec, and thawed
    again at once in the parent; the workers keep them frozen. Where the program froze
    objects of its own, thawing would thaw those too: the parent's garbage is collected
    before the fork instead, so the workers inherit none. With no workers nothing is
    forked and nothing is frozen.
    """

    def __iter__(self) -> Any:
        if not self._forks():
            return super().__iter__()
        with _FORKING:  # one loader at a time: another's thaw cannot reach our fork
            if gc.get_freeze_count():  # the program's own freeze stays as it is
                gc.collect()
                return super().__iter__()
            gc.freeze()
            try:
                return super().__iter__()
            finally:
                gc.unfreeze()

    def _forks(self) -> bool:
        """Whether this ``iter()`` forks workers: some are asked for, persistent ones
        are not running already, and the start method is fork (the default on Linux)."""
        if not self.num_workers or (self.persistent_workers and self._iterator is not None):
            return False
        context = self.multiprocessing_context
        return context is None or context.get_start_method() == "fork"


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` that seeds NumPy and ``random`` in a DataLoader worker.

    Each worker's ``torch.initial_seed()`` is the loader's base seed plus the worker id, so
    seeding from it gives every worker its own stream, and fixing the loader's
    ``generator`` fixes all three libraries. Recent torch versions seed NumPy and
    ``random`` in workers too (from the same base seed); this makes the rule explicit and
    independent of the torch version, so random augmentations never repeat across workers.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(list(range(8)), num_workers=0, worker_init_fn=seed_worker)
    """
    seed = torch.initial_seed()  # this worker's seed: base seed + worker_id
    np.random.seed(seed % 2**32)  # NumPy takes 32-bit seeds
    random.seed(seed)


@dataclass
class TrainLoader:
    """The training loader and what the loop needs to track its position.

    Attributes:
        loader: the DataLoader.
        sampler: the resumable sampler (``state_dict(consumed)`` / ``load_state_dict``).
        unit: what one ``consumed`` count is per batch: ``batch_size`` samples ("fixed")
            or 1 batch ("tokens").
        variable: batches differ in size (count samples and tokens per batch).
        stream: the loader reads a stream (the sampler is a ``StreamShard``): an epoch's
            length is known only once its pass ends.
    """

    loader: DataLoader
    sampler: Any
    unit: int
    variable: bool
    stream: bool = False
    _counts: dict[int, int] = field(default_factory=dict, repr=False)

    def reshard(self, shard: int, shards: int) -> None:
        """Read shard ``shard`` of ``shards`` from the next pass on (the ranks regrouped
        at another world size); the sampler's position is restored after this."""
        self.sampler.rank, self.sampler.world_size = shard, shards
        self._counts.clear()

    def batches_in_epoch(self, epoch: int) -> int:
        """Batches this rank reads in ``epoch`` (token batching: they vary by epoch); a
        stream's are not known before its pass ends (ask :attr:`stream` first)."""
        assert not self.stream, "a stream's batches are counted as they come"
        if epoch not in self._counts:
            plan = getattr(self.sampler, "epoch_batches", None)
            self._counts[epoch] = (len(plan(epoch)) // self.sampler.world_size
                                   if plan is not None else len(self.loader))
        return self._counts[epoch]


def loader_options(cfg: DataConfig, workers: int, pin_memory: bool) -> dict[str, Any]:
    options: dict[str, Any] = {
        "num_workers": workers, "pin_memory": pin_memory, "worker_init_fn": seed_worker,
        # The loop reseeds this per epoch; see gpufleet.train.engine.stream.TrainStream.
        "generator": torch.Generator(),
        # Workers live for the whole run instead of being forked again every epoch.
        "persistent_workers": workers > 0,
    }
    if workers > 0:
        options["prefetch_factor"] = cfg.prefetch_factor
    return options


def train_collate(data: Dataset, cfg: DataConfig) -> Any:
    """How training samples become a batch: the data set's own ``collate_fn``, else
    padding ("tokens" batching) or torch's default collation."""
    own = getattr(data, "collate_fn", None)
    if own is not None:
        return own
    return pad_collate if cfg.batching == "tokens" else default_collate


def build_train_loader(data: Dataset, cfg: DataConfig, *, rank: int, world_size: int,
                       seed: int, pin_memory: bool) -> TrainLoader:
    """The training loader for this rank."""
    options = loader_options(cfg, cfg.num_workers, pin_memory)
    if cfg.batching == "tokens":
        lengths = getattr(data, "lengths", None)
        if lengths is None:
            raise ConfigError(
                f"data.batching = 'tokens' needs the data set's sample lengths, and "
                f"{type(data).__name__} has no `lengths` attribute. Add `lengths` (one int "
                "per sample) to your Dataset, or use data.batching=fixed.")
        if cfg.token_budget <= 0:
            raise ConfigError("data.batching = 'tokens' needs data.token_budget > 0 (tokens "
                              "per batch, padding included), e.g. data.token_budget=8192.")
        sampler = BucketBatchSampler(
            lengths, token_budget=cfg.token_budget, max_samples=cfg.max_samples,
            max_len=cfg.max_len, sort_size=cfg.sort_size, rank=rank, world_size=world_size,
            seed=seed, shuffle=cfg.shuffle)
        loader = ForkSafeLoader(data, batch_sampler=sampler,
                                collate_fn=train_collate(data, cfg), **options)
        return TrainLoader(loader, sampler, unit=1, variable=True)
    sampler = ResumableDistributedSampler(len(data), rank=rank, world_size=world_size,
                                          shuffle=cfg.shuffle, seed=seed)
    if len(sampler) < cfg.batch_size:
        raise ConfigError(
            f"the training set gives each of {world_size} rank(s) {len(sampler)} samples, "
            f"fewer than data.batch_size={cfg.batch_size}. Lower data.batch_size or use "
            "more data.")
    # drop_last: every step sees a full batch, so every rank runs the same number.
    loader = ForkSafeLoader(data, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                            collate_fn=train_collate(data, cfg), **options)
    return TrainLoader(loader, sampler, unit=cfg.batch_size, variable=False)


def first_samples(data: Any, count: int) -> list[Any]:
    """The first ``count`` samples of a data set (fewer if it holds fewer), or of a
    stream (an ``IterableDataset``: read from its start, as every reader reads it).

    Example:
        >>> first_samples([10, 11, 12], 2)
        [10, 11]
    """
    if isinstance(data, IterableDataset):
        return list(itertools.islice(iter(data), count))
    return [data[i] for i in range(min(count, len(data)))]


def check_stream(cfg: Config, data: IterableDataset) -> None:
    """What a run over a stream ``data`` (an ``IterableDataset``) cannot be asked for,
    refused before any rank starts (the launching process) and again on each rank.

    Raises:
        ConfigError: ``run.max_epochs`` (a stream has no length to turn epochs into
            steps: ``run.max_steps`` says when to stop), ``data.batching = "tokens"``
            (its batches are planned from every sample's length), or a stream that
            splits itself (:func:`~gpufleet.data.stream_shard.check_source`).
    """
    if cfg.run.max_epochs:
        steps = (f"run.max_steps = {cfg.run.max_steps} stops it alone" if cfg.run.max_steps > 0
                 else "give run.max_steps (e.g. run.max_steps=1000)")
        raise ConfigError(
            f"run.max_epochs = {cfg.run.max_epochs}, and the training data is a stream (an "
            "IterableDataset): a stream has no length, so epochs cannot say when to stop "
            "(its end is seen only when a pass is read past, in the middle of a step). "
            f"Set run.max_epochs=0; {steps}. Epochs are still counted, as passes of the "
            "stream as they end.")
    if cfg.data.batching == "tokens":
        raise ConfigError(
            "data.batching = 'tokens' plans batches from every sample's length, and the "
            "training data is a stream (an IterableDataset) with no lengths up front. Use "
            "data.batching=fixed (data.batch_size items a batch), or give a map-style "
            "Dataset with `lengths`.")
    check_source(data, cfg.data.num_workers)


def stream_loader(share: StreamShard, **options: Any) -> DataLoader:
    """A loader over a rank's share of a stream, batches of ``share.unit`` items: the
    DataLoader ``options`` (``batch_size``, ``num_workers``, ``collate_fn``...), except
    that the workers are started for each pass (persistent ones would keep the share
    as it was at their start, not the position a pass starts from). A stream that
    splits itself is refused (:func:`~gpufleet.data.stream_shard.check_source`).

    Example:
        >>> share = StreamShard(range(10), unit=2, rank=0, world_size=1)  # doctest: +SKIP
        >>> loader = stream_loader(share, batch_size=2, num_workers=0)  # doctest: +SKIP
    """
    check_source(share.source, options.get("num_workers") or 0)
    options["persistent_workers"] = False
    if not options.get("num_workers"):  # torch refuses it without workers
        options.pop("prefetch_factor", None)
    return ForkSafeLoader(share, **options)


def build_stream_loader(data: IterableDataset, cfg: Config, *, rank: int, world_size: int,
                        pin_memory: bool) -> TrainLoader:
    """The training loader of this rank's share of a stream: chunk ``rank`` of every row
    of ``world_size`` batches, full batches only (a short last row is left out and
    logged), its position kept by the share."""
    check_stream(cfg, data)
    if cfg.data.shuffle and rank == 0:
        log.info("the training data is a stream: it is read in its own order "
                 "(data.shuffle applies to map-style data; a stream shuffles itself, "
                 "told each epoch through its set_epoch)")
    share = StreamShard(data, unit=cfg.data.batch_size, rank=rank, world_size=world_size,
                        drop_last=True)
    options = loader_options(cfg.data, cfg.data.num_workers, pin_memory)
    loader = stream_loader(share, batch_size=cfg.data.batch_size,
                           collate_fn=train_collate(data, cfg.data), **options)
    return TrainLoader(loader, share, unit=cfg.data.batch_size, variable=False, stream=True)


def build_eval_loader(data: Dataset | None, cfg: DataConfig, *, rank: int, world_size: int,
                      pin_memory: bool) -> DataLoader | None:
    """Evaluation loader: every sample on exactly one rank, fixed batches (padded for
    variable-length data), so cross-rank sums count each sample once. A stream is read
    whole on every evaluation, each rank its chunks of it (the last row shared out as
    far as it goes: some ranks may read a batch fewer)."""
    if isinstance(data, IterableDataset):
        share = StreamShard(data, unit=cfg.batch_size, rank=rank, world_size=world_size,
                            drop_last=False)
        return stream_loader(share, batch_size=cfg.batch_size,
                             collate_fn=getattr(data, "collate_fn", None) or default_collate,
                             **loader_options(cfg, cfg.num_workers, pin_memory))
    if data is None or len(data) == 0:
        return None
    sampler = ResumableDistributedSampler(len(data), rank=rank, world_size=world_size,
                                          eval_mode=True)
    collate = getattr(data, "collate_fn", None) or (
        pad_collate if cfg.batching == "tokens" else None)
    return ForkSafeLoader(data, batch_size=cfg.batch_size, sampler=sampler,
                          collate_fn=collate, **loader_options(cfg, cfg.num_workers, pin_memory))
