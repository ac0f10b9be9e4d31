"""Your DataLoader, sharded over the ranks and resumable at any batch: :class:`FleetLoader`.

:meth:`gpufleet.fleet.Fleet.setup_dataloaders` rebuilds your loader around gpufleet's
:class:`~gpufleet.data.sampler.ResumableDistributedSampler` (every rank draws the same
permutation and takes every ``world_size``-th index of it, as torch's
``DistributedSampler`` does with the same seed; in a job of one process, the order the
loader's own ``RandomSampler`` would give). The loader counts the samples your loop
has taken, so that :meth:`~gpufleet.fleet.Fleet.save` records the exact position, and
tells the run that a batch is being waited for (the data phase).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from gpufleet.core.tree import batch_size_of, tokens_of
from gpufleet.data.loaders import ForkSafeLoader
from gpufleet.data.sampler import ResumableDistributedSampler
from gpufleet.errors import ConfigError
from gpufleet.fleet.order import AccelerateOrder

# DataLoader arguments carried over to the rebuilt loader as they were.
_KEPT = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
         "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
         "persistent_workers", "pin_memory_device")


def shard_loader(loader: DataLoader, *, rank: int, world_size: int, seed: int,
                 order: Sampler | None = None
                 ) -> tuple[DataLoader, ResumableDistributedSampler]:
    """``loader`` rebuilt to read this rank's shard through a resumable sampler.

    A loader that shuffled (a ``RandomSampler``) gets a shuffled permutation per epoch:
    on several ranks drawn from ``seed + epoch`` (``DistributedSampler``'s order, as
    Fabric's); in a job of one process the order the ``RandomSampler`` itself gives (its
    seed drawn from torch's random state each epoch, or its own generator, replacement
    and number of samples). A ``SequentialSampler``'s order is ``0..n-1``. A
    ``DistributedSampler`` of your own (a plain PyTorch loop's) lends its shuffle, seed
    and ``drop_last``: the order it gives when your loop sets its epoch every epoch,
    without sharding it twice. Any other
    sampler (weighted, a subset, yours) keeps its own draws each epoch, sharded over
    the ranks as Fabric's ``DistributedSamplerWrapper`` shards them. ``order`` (an
    :class:`~gpufleet.fleet.order.AccelerateOrder`) is each epoch's order instead, every
    ``world_size``-th item of it this rank's.

    Raises:
        ConfigError: the loader cannot be sharded this way (an iterable dataset, a
            batch sampler of its own).
    """
    if not isinstance(loader, DataLoader):
        raise ConfigError(f"setup_dataloaders got {type(loader).__name__}; give a "
                          "torch.utils.data.DataLoader.")
    if isinstance(loader.dataset, IterableDataset):
        raise ConfigError("setup_dataloaders got a DataLoader over an IterableDataset; "
                          "gpufleet shards and resumes map-style datasets (__len__ and "
                          "__getitem__). Shard the stream yourself and pass "
                          "use_distributed_sampler=False.")
    try:
        len(cast(Sized, loader.dataset))  # what is checked: a TypeError without __len__
    except TypeError:
        raise ConfigError(f"setup_dataloaders got a DataLoader whose dataset "
                          f"({type(loader.dataset).__name__}) has no len(); give it "
                          "__len__, or pass use_distributed_sampler=False and shard it "
                          "yourself.") from None
    if loader.batch_size is None:
        raise ConfigError("setup_dataloaders got a DataLoader with a batch_sampler of its "
                          "own; give batch_size= instead, or pass "
                          "use_distributed_sampler=False and shard it yourself.")
    sampler = _resumable(loader, rank, world_size, seed) if order is None else \
        ResumableDistributedSampler(len(cast("Sized", order)), rank=rank,
                                    world_size=world_size, shuffle=False, seed=seed,
                                    source=order)
    kwargs = {k: getattr(loader, k) for k in _KEPT if hasattr(loader, k)}
    if not kwargs.get("num_workers"):  # torch refuses these without workers
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    return ForkSafeLoader(loader.dataset, sampler=sampler, **kwargs), sampler


def _resumable(loader: DataLoader, rank: int, world_size: int, seed: int
               ) -> ResumableDistributedSampler:
    """The resumable sampler that reads ``loader``'s sampler's order (see
    :func:`shard_loader`)."""
    theirs = loader.sampler
    if isinstance(theirs, DistributedSampler):  # it shards already: its order, ours
        return ResumableDistributedSampler(len(cast("Sized", loader.dataset)), rank=rank,
                                           world_size=world_size, shuffle=theirs.shuffle,
                                           seed=theirs.seed, drop_last=theirs.drop_last)
    shuffle = isinstance(theirs, RandomSampler)
    # One process: the shuffle your RandomSampler would draw (its seed from torch's
    # random state, each epoch); several: DistributedSampler's, from ``seed``.
    plain = shuffle and type(theirs) is RandomSampler and theirs.generator is None and \
        not theirs.replacement and theirs.num_samples == len(cast("Sized", loader.dataset))
    # The sampler's own draws are the order: a sampler of your own (on any number of
    # ranks, as Fabric's DistributedSamplerWrapper), or alone a RandomSampler that is
    # not plain (as Fabric keeps a loader on one device).
    own = not isinstance(theirs, SequentialSampler) and not plain and \
        not (shuffle and world_size > 1)
    if not own:
        return ResumableDistributedSampler(len(cast("Sized", loader.dataset)), rank=rank,
                                           world_size=world_size, shuffle=shuffle,
                                           seed=seed, draw_seeds=plain)
    try:
        count = len(cast("Sized", theirs))
    except TypeError:
        raise ConfigError(f"setup_dataloaders got a DataLoader whose sampler "
                          f"({type(theirs).__name__}) has no len(); give it __len__, or "
                          "pass use_distributed_sampler=False and shard it yourself.") from None
    return ResumableDistributedSampler(count, rank=rank, world_size=world_size,
                                       shuffle=False, seed=seed,
                                       source=cast(Sampler, theirs))


class FleetLoader:
    """Iterates like the loader it wraps; knows its position in the data.

    Args:
        loader: the loader to iterate (already sharded, or yours as it was).
        sampler: its resumable sampler, or None when the loader was left as it was
            (then there is no position to save).
        on_batch: called before each batch is fetched (the data phase begins).
        to_device: moves a batch to the run's device (None: leave it).
        device: the device the batches are for (None: not moved there).

    Attributes:
        consumed: batches' samples this rank has taken in the current epoch.
        samples / tokens: samples, and tokens (integer ids of shape [batch, time]),
            taken since the run last counted them (throughput).
    """

    def __init__(self, loader: DataLoader, sampler: ResumableDistributedSampler | None,
                 on_batch: Callable[[], None], to_device: Callable[[Any], Any] | None = None,
                 device: torch.device | None = None) -> None:
        self.loader, self.sampler = loader, sampler
        #: the device the batches are for (None: setup_dataloaders(move_to_device=False)),
        #: as Fabric's loader's ``device``
        self.device = device
        self._on_batch, self._to_device = on_batch, to_device
        self.consumed = 0
        self.samples = self.tokens = 0
        self._ended = False  # the last pass was read to its end (StopIteration)
        self._resumed_mid_pass = False  # loaded a position inside an epoch
        self._passes = 0  # passes begun (numbers them)
        self._live: tuple[int, int] | None = None  # the pass under way: (number, epoch)
        self._taken = 0  # batches the pass under way handed out
        #: the last batch handed out: (its epoch, its first item's position in this
        #: rank's share of the epoch, its size), for gather_for_metrics
        self.last_batch: tuple[int, int, int] | None = None
        self.reads = 0  # batches handed out by this loader (which was read last)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        """The wrapped DataLoader's other attributes (``num_workers``,
        ``worker_init_fn``, ``collate_fn``...), readable here as on Fabric's loader."""
        if name.startswith("_") or "loader" not in vars(self):  # (unpickling, copying)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.loader, name)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    @property
    def epoch(self) -> int:
        """The epoch being read (0 before the first batch)."""
        return self.sampler.epoch if self.sampler is not None else 0

    def set_epoch(self, epoch: int) -> None:
        """Start the next pass at the beginning of ``epoch``; the epoch being read (or
        resumed) keeps its position. Not needed: a pass read to its end moves to the
        next epoch by itself."""
        if self.sampler is not None and epoch != self.sampler.epoch:
            self.sampler.set_epoch(epoch)
            self.consumed = 0
            self._live = None  # the pass under way, if any, no longer decides the next

    def __iter__(self) -> Iterator[Any]:
        """A pass over the epoch, from its saved position after a load.

        One pass at a time, and a pass your loop leaves before its end (a ``break``, an
        ``iter()`` dropped or begun anew) ends that epoch, as a new pass of a DataLoader
        starts afresh: the next pass reads the next epoch from its start (in one
        process, in a newly drawn order, as your loader's own ``RandomSampler`` would),
        and a checkpoint saved in between resumes there. A loop that keeps its iterator
        (``it = iter(loader)``) reads on in the epoch."""
        if self._live is not None:  # a pass begun anew: the one under way is left
            self._leave(*self._live)
        self._passes += 1
        epoch = self.sampler.epoch if self.sampler is not None else 0
        self._live, self._taken = (self._passes, epoch), 0
        return self._pass(self._passes, epoch)

    def _leave(self, number: int, epoch: int) -> None:
        """Pass ``number`` (of ``epoch``) ended: if it took a batch and stopped before
        the end of its items, the next pass begins the next epoch."""
        if self._live is None or self._live[0] != number:
            return  # not the pass under way (a newer one began, or a load since)
        self._live = None
        if self._taken and not self._ended and self.sampler is not None:
            self.sampler.set_epoch(epoch + 1)
            self._ended, self.consumed = True, 0

    def _pass(self, number: int, epoch: int) -> Iterator[Any]:
        """Pass ``number`` of ``epoch``: its batches, counted, then :meth:`_leave`."""
        batches: Iterator[Any] | None = None
        on_batch, to_device = self._on_batch, self._to_device
        try:
            while True:
                on_batch()  # the data phase begins (a stop agreed on happens here)
                if batches is None:  # (after on_batch: the pass's start is data time,
                    batches = self._start_pass()  # and a stop saves before its draws)
                batch = next(batches, _END)
                if batch is _END:
                    self._ended = True
                    return
                n = batch_size_of(batch)
                self._taken += 1
                self.last_batch = (epoch, self.consumed, n)
                self.reads = next(_READS)
                self.consumed += n
                self.samples += n
                self.tokens += tokens_of(batch) or 0  # (shapes on the host: no sync)
                yield batch if to_device is None else to_device(batch)
        finally:  # read to its end, or left (GeneratorExit)
            self._leave(number, epoch)

    def _start_pass(self) -> Iterator[Any]:
        """The loader's iterator for a pass beginning now (at its first batch)."""
        if self.sampler is not None:
            # Counted from where this pass starts in the sampler's items (0 for a new
            # epoch and for a resumed one, whose items begin after the saved position).
            self.consumed = self.sampler.position
        self._ended = False
        if not self._resumed_mid_pass:
            return iter(self.loader)
        # A DataLoader draws its workers' base seed from torch's RNG (or its own
        # generator) when the pass starts. The uninterrupted run drew it before the saved
        # RNG state, so the resumed pass must not draw again (dropout masks, a sampler's
        # next draws would shift).
        self._resumed_mid_pass = False
        generators = self._generators()
        rng, states = torch.get_rng_state(), [g.get_state() for g in generators]
        batches = iter(self.loader)
        torch.set_rng_state(rng)
        for g, state in zip(generators, states, strict=True):
            g.set_state(state)
        return batches

    def _generators(self) -> list[torch.Generator]:
        """The generators of your own that this loader's passes draw from: the
        DataLoader's (its workers' base seed) and its sampler's (the order)."""
        found: list[torch.Generator] = []
        source = getattr(self.sampler, "source", None)
        for g in (getattr(self.loader, "generator", None), getattr(source, "generator", None)):
            if isinstance(g, torch.Generator) and all(g is not h for h in found):
                found.append(g)
        return found

    @property
    def at_last_batch(self) -> bool:
        """The last batch handed out was the last of its pass (what Accelerate calls the
        end of the dataloader)."""
        if self.last_batch is None:
            return False
        epoch, start, n = self.last_batch
        if self.sampler is not None:
            return start + n >= self.sampler._count(epoch)
        try:
            return self._taken >= len(self.loader)
        except TypeError:  # no len(): known only once the pass has ended
            return self._ended

    def real_items(self, rank: int) -> int | None:
        """How many items of the last batch handed out (on ``rank``: every rank's batch
        has the same size and position) are samples of the data set, not the padding
        the sampler repeats so that every rank reads as many (None: not known, the
        loader was left as it was)."""
        sampler = self.sampler
        if sampler is None or self.last_batch is None:
            return None
        epoch, start, n = self.last_batch
        if sampler.drop_last:
            return n
        skipped = sampler._skipped(epoch)  # the epoch's samples an earlier run read
        if isinstance(sampler.source, AccelerateOrder):  # its padding: each rank's last
            real = sampler.source.real_items(epoch, rank) - skipped // sampler.world_size
        else:  # the padding: the positions past the epoch's samples
            real = len(range(rank, sampler.dataset_len - skipped, sampler.world_size))
        return max(0, min(start + n, real) - start)

    def take_counts(self) -> tuple[int, int]:
        """Samples and tokens taken since the last call."""
        counts, self.samples, self.tokens = (self.samples, self.tokens), 0, 0
        return counts

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from (see ``ResumableDistributedSampler.state_dict``)."""
        if self.sampler is None:
            raise ConfigError("this loader was set up with use_distributed_sampler=False: "
                              "gpufleet does not know its position. Save your own sampler's "
                              "state instead, or let setup_dataloaders shard the loader.")
        if self._ended:  # the loop left the pass: the next one starts the next epoch
            state: dict[str, Any] = self.sampler.state_dict()
        else:
            # Inside a pass (its last batch included): the samples taken, not the
            # sampler's own count, which a DataLoader runs ahead of the batches handed out.
            state = self.sampler.state_dict(consumed=self.consumed)
        generators = self._generators()  # their next draws continue where they were
        if generators:
            state["generators"] = [g.get_state() for g in generators]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue, at the next ``iter()``, right after the saved position."""
        if self.sampler is None:
            raise ConfigError("this loader was set up with use_distributed_sampler=False "
                              "and has no position to load.")
        self.sampler.load_state_dict(state)
        generators = self._generators()
        if len(state.get("generators", ())) == len(generators):
            for g, saved in zip(generators, state.get("generators", ()), strict=True):
                g.set_state(saved)
        self._resumed_mid_pass = state["samples"] > 0
        self._ended = False
        self._live = None  # a pass under way no longer decides where the next begins
        self.consumed = 0  # the resumed pass's items begin after the saved position


class SetUpLoaders:
    """The loaders your loop set up, as the run reads its training data (a
    :class:`~gpufleet.train.engine.view.DataCounts`: the log line's epoch and
    throughput, the view's epoch and pinning).

    Attributes:
        loaders: every :class:`FleetLoader` set up, the first being the training one.
        pin_memory: some loader pins its batches.
        data_copies: ranks that read each sample (the strategy's data shards: pipeline
            stages read the same data).
    """

    def __init__(self) -> None:
        self.loaders: list[FleetLoader] = []
        self.pin_memory = False
        self.data_copies = 1

    def add(self, loader: FleetLoader, data_copies: int) -> None:
        """``loader`` was set up; each of its samples is read by ``data_copies`` ranks."""
        self.loaders.append(loader)
        self.pin_memory = self.pin_memory or bool(loader.loader.pin_memory)
        self.data_copies = data_copies

    @property
    def epoch(self) -> int:
        """The epoch the first loader is reading."""
        return self.loaders[0].epoch if self.loaders else 0

    @property
    def epochs_done(self) -> float:
        """The epochs the first loader has begun (your loop's passes)."""
        return float(self.epoch)

    def take_counts(self) -> tuple[int, int]:
        """Training samples and tokens taken from every loader since the last call."""
        taken = [loader.take_counts() for loader in self.loaders]
        return sum(n for n, _ in taken), sum(t for _, t in taken)

    def read_last(self) -> FleetLoader | None:
        """The loader that handed out the newest batch (None before any)."""
        read = [x for x in self.loaders if x.last_batch is not None]
        return max(read, key=lambda x: x.reads) if read else None


_END = object()
_READS = itertools.count(1)
