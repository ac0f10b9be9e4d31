"""Where a resumable sampler is: the bookkeeping both of our samplers share.

A sampler yields this rank's items of one epoch per pass (indices, or batches of them).
This module tracks which epoch the next ``iter()`` yields from, how far into it this
rank is, and which pass is live; the epoch advances by itself when a pass runs to the
end. A subclass only says what its items of an epoch are (:meth:`EpochPasses._items`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any


def check_int(name: str, value: object, low: int) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) of at least ``low``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} = {value!r}: must be an integer >= {low}.")


def check_shard(rank: object, world_size: object, seed: object) -> None:
    """Raise unless ``rank`` is one of ``world_size`` ranks and ``seed`` is an int."""
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0)
    if rank >= world_size:  # type: ignore[operator]
        raise ValueError(f"rank = {rank} is out of range for world_size = {world_size}; "
                         f"ranks run from 0 to {world_size - 1}.")  # type: ignore[operator]
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed = {seed!r}: must be an int.")


class EpochPasses:
    """Mixin for samplers that resume mid-epoch. Call :meth:`_init_passes` in
    ``__init__`` and implement :meth:`_items`."""

    def _init_passes(self) -> None:
        self.epoch = 0  # the epoch the next iter() yields from
        self._position = 0  # items of that epoch this rank yielded before the live pass
        self._live: Iterator[Any] | None = None  # the pass being iterated, if any
        self._live_len = 0
        self._pass_epoch = 0  # epoch of the pass most recently started (see state_dict)

    def _items(self, epoch: int) -> list[Any]:
        """This rank's items of ``epoch``, in order."""
        raise NotImplementedError

    def _count(self, epoch: int) -> int:
        """How many items :meth:`_items` gives for ``epoch`` (override where the items
        themselves cost more than their count, or must not be made yet)."""
        return len(self._items(epoch))

    def _emit(self, live: Iterator[Any]) -> Iterator[Any]:
        """What the caller receives for the live items (override to copy them)."""
        return live

    @property
    def position(self) -> int:
        """Items of the current epoch this rank has yielded so far."""
        if self._live is None:
            return self._position
        # A list iterator knows how many items it has left: no per-item bookkeeping, so
        # a pass costs what iterating a plain list costs.
        return self._live_len - operator.length_hint(self._live)

    @position.setter
    def position(self, value: int) -> None:
        self._live, self._position = None, value

    def _start_pass(self) -> Iterator[Any]:
        """The iterator ``__iter__`` returns: the current epoch from ``position`` on."""
        epoch, start = self.epoch, self.position
        self._pass_epoch = epoch
        # Set up eagerly (a generator body would only run at the first next()), so
        # `position` is right from the moment iter() returns.
        items = self._items(epoch)
        live = iter(items)
        for _ in range(start):  # skip what an earlier run already consumed
            next(live)
        self._live, self._live_len = live, len(items)
        return self._drain(live, epoch)

    def _drain(self, live: Iterator[Any], epoch: int) -> Iterator[Any]:
        yield from self._emit(live)
        if self._live is live:
            self.epoch, self.position = epoch + 1, 0  # the pass ran to the end

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at the beginning of ``epoch``."""
        check_int("epoch", epoch, 0)
        self.epoch, self.position, self._pass_epoch = epoch, 0, epoch

    def _saved_position(self, consumed: int | None, name: str) -> tuple[int, int]:
        """``(epoch, position)`` for a state dict: the sampler's own place, or ``consumed``
        items into the pass most recently started (a DataLoader runs samplers ahead)."""
        if consumed is None:
            return self.epoch, self.position
        epoch = self._pass_epoch
        total = self._count(epoch)
        if not isinstance(consumed, int) or isinstance(consumed, bool) \
                or not 0 <= consumed <= total:
            raise ValueError(f"{name} = {consumed!r}: must be an int from 0 to {total} "
                             f"(this rank's items in epoch {epoch}).")
        return epoch, consumed

    def _restore_position(self, epoch: Any, position: Any) -> None:
        """Make the next ``iter()`` continue ``position`` items into ``epoch``."""
        check_int("epoch", epoch, 0)
        total = self._count(epoch)
        if not isinstance(position, int) or not 0 <= position <= total:
            raise ValueError(f"sampler state position = {position!r}: must be from 0 to "
                             f"{total} (this rank's items in epoch {epoch}).")
        self.epoch, self.position, self._pass_epoch = epoch, position, epoch
