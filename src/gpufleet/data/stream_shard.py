"""An ``IterableDataset`` read by several ranks and workers, each a disjoint share, with
a position to resume from: :class:`StreamShard`.

A stream has no indices to deal out, so every reader (each rank's each loader worker)
reads the stream from its start and keeps its own items of it: the stream is cut into
rows of one chunk of ``unit`` items (a batch) for each rank; rank ``k`` keeps the
``k``-th chunk of every row, and of ``W`` workers on a rank, worker ``w`` reads the
``w``-th row of every ``W``. The ``j``-th batch rank ``k``'s loader hands out (its
workers take turns) is then chunk ``k`` of row ``j``, whatever the number of workers:
every item is read by one rank once, and the ranks together read the stream in its
order, as a sampler of ``world_size`` ranks deals a dataset out.

* **Evenness**: on several ranks a last row too short for every rank's chunk is
  left out (every rank must hand out as many batches, or a collective of the training
  step would wait forever); the items left out are logged, never dropped silently. On
  one rank the last chunk may be short (a last partial batch, as the loader's own),
  unless ``drop_last`` (``fit``'s training stream: every step a full batch) leaves it
  out too, logged. An evaluation share (``drop_last=False`` on several ranks) keeps the
  short row: each rank its part of it, some none.
* **Position**: the items of the epoch every rank has read before a batch, so
  :meth:`state_dict` is the same on every rank of a loop in step, and a resumed pass
  (at any number of workers, or of ranks) starts after it.
* **Epochs**: a pass read to its end ends the epoch (the loader that saw the end calls
  :meth:`StreamShard.pass_ended`); the source's own ``set_epoch``, if it has one (a
  shuffling stream's), is told each epoch before it is read.
* **Cost**: each reader reads the whole stream (and the items before a resumed
  position again), keeping one chunk in ``ranks x workers``; a stream must give every reader
  the same items in the same order (one that splits itself by ``get_worker_info()`` or
  by rank would leave items out: read it without this shard). A Hugging Face
  ``IterableDataset`` splits itself over a loader's workers, and over the ranks once
  ``split_dataset_by_node`` was applied: :func:`check_source` refuses both, naming the
  fix.

Example:
    >>> class Count(IterableDataset):
    ...     def __iter__(self):
    ...         return iter(range(10))
    >>> [list(StreamShard(Count(), unit=2, rank=r, world_size=2)) for r in (0, 1)]
    [[0, 1, 4, 5], [2, 3, 6, 7]]
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from gpufleet.errors import ConfigError

log = logging.getLogger(__name__)


def check_source(source: Any, workers: int) -> None:
    """Refuse a stream that would split itself under a share read by ``workers`` loader
    workers (each reader must read the whole stream), naming the fix: a Hugging Face
    ``IterableDataset`` gives each worker only its shards (with more workers than shards
    some read nothing), and one passed through ``split_dataset_by_node`` gives each rank
    only its part (the share then splits it again).

    Raises:
        ConfigError: ``source`` is such a stream (the checks know Hugging Face's only:
            another that splits itself is not seen here).
    """
    if type(source).__module__.split(".")[0] != "datasets":
        return
    if getattr(source, "_distributed", None) is not None:
        raise ConfigError(
            "the stream is a Hugging Face IterableDataset split by node already "
            "(split_dataset_by_node): each rank would read only its part and keep a "
            "share of that. Give the whole stream: gpufleet gives each rank its chunks.")
    if workers > 0:
        raise ConfigError(
            f"the stream is a Hugging Face IterableDataset, read by {workers} loader "
            "worker(s): it gives each worker only its shards, and every worker must read "
            "the whole stream to keep its own batches of it (items would be lost). Read "
            "it with no loader workers: data.num_workers=0 in fit, DataLoader(..., "
            "num_workers=0) in your own loop.")


class StreamShard(IterableDataset):
    """``source`` read as this rank's share (see the module doc).

    Args:
        source: the stream (an ``IterableDataset``), the same in every process.
        unit: items per chunk: the loader's batch size (1 when the stream yields
            batches itself).
        rank / world_size: this rank's share of ``world_size``.

    Attributes:
        epoch: the epoch the next pass reads.
        skip: items of that epoch every rank read before (a resumed position).
    """

    def __init__(self, source: IterableDataset, *, unit: int, rank: int,
                 world_size: int, drop_last: bool | None = None) -> None:
        if unit < 1 or not 0 <= rank < world_size:
            raise ValueError(f"StreamShard(unit={unit}, rank={rank}, world_size="
                             f"{world_size}): give unit >= 1 and 0 <= rank < world_size.")
        self.source, self.unit = source, unit
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.skip = 0
        # A short last row is left out (None: on several ranks, where they must read alike).
        self.drop_last = world_size > 1 if drop_last is None else drop_last

    @property
    def position(self) -> int:
        """Items of this rank's share read before a pass starts (a pass always starts
        at its epoch's position: the state's ``skip`` counts what came before)."""
        return 0

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        set_epoch = getattr(self.source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        return self._read(worker, workers, announce=worker == 0 and self.rank == 0)

    def _read(self, worker: int, workers: int, announce: bool) -> Iterator[Any]:
        """Worker ``worker`` of ``workers`` on this rank: this rank's chunk of every
        ``workers``-th row after ``skip`` (a row: one chunk for each rank)."""
        items = iter(self.source)
        if self.skip:  # the position: what every rank read before
            next(itertools.islice(items, self.skip - 1, None), None)
        row_items = self.world_size * self.unit
        first, stop = self.rank * self.unit, (self.rank + 1) * self.unit
        for row in itertools.count():
            mine, seen = [], 0
            for seen, item in enumerate(itertools.islice(items, row_items), 1):
                if row % workers == worker and first <= seen - 1 < stop:
                    mine.append(item)
            if seen < row_items and self.drop_last:
                if seen and announce:
                    log.warning(
                        "stream: the last %d item(s) of epoch %d are left out: fewer than "
                        "a full batch of %d for each of %d rank(s) (every rank reads as "
                        "many batches, each full)", seen, self.epoch, self.unit,
                        self.world_size)
                return
            yield from mine
            if seen < row_items:
                return

    # -- the position (what a checkpoint keeps) --------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next pass reads ``epoch`` from its start."""
        self.epoch, self.skip = epoch, 0

    def pass_ended(self, epoch: int) -> None:
        """A pass over ``epoch`` was read to its end (seen by the loader, in the process
        that holds this share: its workers hold copies): the next pass reads the next
        epoch, unless the position was set to another since."""
        if self.epoch == epoch:
            self.set_epoch(epoch + 1)

    def ledger_segment(self, epoch: int) -> dict[str, Any]:
        """What the data ledger (:mod:`gpufleet.data.ledger`) records of ``epoch`` before
        this rank reads from it: a stream's positions are its items' places in the pass,
        rank ``shard`` of ``world`` reading chunk ``shard`` of every row of
        ``world x chunk`` after ``skip``; the pass's length is not known (``n`` and
        ``items`` None).

        Example:
            >>> StreamShard(None, unit=4, rank=1, world_size=2).ledger_segment(0)["chunk"]
            4
        """
        return {"kind": "stream", "epoch": epoch, "n": None, "seed": None,
                "skip": self.skip if epoch == self.epoch else 0, "world": self.world_size,
                "shard": self.rank, "pad": False, "items": None, "chunk": self.unit}

    def state_dict(self, consumed: int | None = None) -> dict[str, int]:
        """The position after ``consumed`` items of this rank's share of the epoch
        (None: the start of :attr:`epoch`), as the items of the stream every rank
        read: ``{"epoch", "samples", "unit", "world_size"}``.

        Example:
            >>> StreamShard(None, unit=4, rank=1, world_size=2).state_dict(consumed=8)
            {'epoch': 0, 'samples': 16, 'unit': 4, 'world_size': 2}
        """
        consumed = consumed or 0
        chunks, rest = divmod(consumed, self.unit)  # rest: a short last chunk (1 rank)
        samples = self.skip + chunks * self.unit * self.world_size + rest
        return {"epoch": self.epoch, "samples": samples, "unit": self.unit,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next pass starts after ``state``'s position (saved at any number of
        ranks or workers).

        Raises:
            ValueError: the state was saved with another batch size (its chunks would
                not fall on this one's), or is not a stream's position.
        """
        if not {"epoch", "samples", "unit"} <= set(state):
            raise ValueError(f"a stream's position has epoch, samples and unit; this state "
                             f"has {sorted(state)} (a map-style loader's?). Load the "
                             "checkpoint of this loop into the same loaders.")
        if state["unit"] != self.unit:
            raise ValueError(
                f"the stream's position was saved with batches of {state['unit']}, and "
                f"this loader's batch size is {self.unit}: the chunks each rank reads would "
                "not line up. Resume with the same batch size.")
        self.epoch, self.skip = int(state["epoch"]), int(state["samples"])
