"""Accelerate's data order on several ranks: :class:`AccelerateOrder`, for
``fleet.setup_dataloaders(loader, order="accelerate")``.

``setup_dataloaders`` shards a loader as torch's ``DistributedSampler`` does (every
rank takes every ``world_size``-th sample of one permutation; Fabric's order).
Accelerate's ``accelerator.prepare`` shards whole batches instead: the loader's own
sampler draws the epoch's order (a shuffling one from one generator, seeded once at
``prepare`` from torch's random state, or the sampler's own generator, and kept the
same on every rank), that order is cut into batches, and batch ``i`` goes to rank
``i % world_size``. Unless the loader drops its last batch, the last round of batches
is completed from the epoch's first samples, so every rank reads as many full batches
("even batches").

:class:`AccelerateOrder` gives that order as one sequence in which rank ``r``'s items
stand at positions ``r, r + world_size, ...``: gpufleet's resumable sampler, which takes
every ``world_size``-th item, then hands each rank exactly the batches Accelerate's
would, and still saves the exact position. Each epoch's order is computed from the
generator's state at setup and the epoch's number, so a resumed run reads the epochs
after the saved one as the uninterrupted run would (at the same world size; at another,
the rest of the saved epoch is split as ``DistributedSampler`` splits it).

Example:
    >>> order = AccelerateOrder(SequentialSampler(range(5)), batch_size=2, world_size=2,
    ...                         drop_last=False)
    >>> order.rank_items(0, 0), order.rank_items(0, 1)  # batches 0, 2 and 1, then padding
    ([0, 1, 4, 0], [2, 3, 1, 2])
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import cast

import torch
from torch.utils.data import RandomSampler, Sampler, SequentialSampler

#: ``order=`` of ``setup_dataloaders``: DistributedSampler's (Fabric's), or Accelerate's.
ORDERS = ("distributed", "accelerate")


class AccelerateOrder(Sampler[int]):
    """The epoch's items in Accelerate's batch sharding, interleaved by rank (see the
    module docs).

    Args:
        sampler: the loader's own ``RandomSampler`` (shuffling) or ``SequentialSampler``.
        batch_size: the loader's batch size.
        world_size: the ranks the batches are dealt to.
        drop_last: the loader's: a last incomplete round of batches is dropped instead of
            completed from the epoch's first samples.
        generator_state: a shuffling sampler's generator state at setup (every rank the
            same; see :func:`accelerate_generator_state`).
    """

    def __init__(self, sampler: Sampler, *, batch_size: int, world_size: int,
                 drop_last: bool, generator_state: torch.Tensor | None = None) -> None:
        if not isinstance(sampler, (RandomSampler, SequentialSampler)):
            raise TypeError(f"AccelerateOrder takes a RandomSampler or a SequentialSampler, "
                            f"not {type(sampler).__name__}")
        self.sampler = sampler
        self.batch_size, self.world_size, self.drop_last = batch_size, world_size, drop_last
        self.generator_state = generator_state
        self.epoch = 0
        self._after: tuple[int, torch.Tensor] | None = None  # (epoch, generator after it)
        self._last: tuple[int, list[int]] | None = None  # (epoch, its order)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` gives (the resumable sampler sets it)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.world_size * self._rows()

    def _rows(self) -> int:
        """Items each rank reads in an epoch."""
        n, b, ws = len(cast(Sized, self.sampler)), self.batch_size, self.world_size
        batches = n // b if self.drop_last else -(-n // b)
        rounds = (n // b) // ws if self.drop_last else -(-batches // ws)
        return rounds * b

    def __iter__(self) -> Iterator[int]:
        per_rank = [self.rank_items(self.epoch, r) for r in range(self.world_size)]
        return (per_rank[r][j] for j in range(self._rows()) for r in range(self.world_size))

    def rank_items(self, epoch: int, rank: int) -> list[int]:
        """Rank ``rank``'s items of ``epoch``, in order (its batches, back to back)."""
        return [i for batch in _deal(self._batches(epoch), self.world_size, rank,
                                     self.batch_size, self.drop_last) for i in batch]

    def real_items(self, epoch: int, rank: int) -> int:
        """How many of rank ``rank``'s items of ``epoch`` come before the padding (the
        rest repeat the epoch's first samples to complete the last round)."""
        rounds, rest = _rounds(self._batches(epoch), self.world_size, self.batch_size)
        last = len(rest[rank]) if not self.drop_last and rank < len(rest) else 0
        return rounds * self.batch_size + last

    def _batches(self, epoch: int) -> list[list[int]]:
        """The loader's batches of ``epoch`` before sharding."""
        order = self._order(epoch)
        b = self.batch_size
        batches = [order[i:i + b] for i in range(0, len(order), b)]
        if self.drop_last and batches and len(batches[-1]) < b:
            batches.pop()
        return batches

    def _order(self, epoch: int) -> list[int]:
        """What the loader's sampler yields in ``epoch``: a shuffling one from the
        generator as it stands after the epochs before (computed again from the state at
        setup, or from the one after the previous epoch, kept)."""
        theirs = self.sampler
        if not isinstance(theirs, RandomSampler):
            return [int(i) for i in theirs]
        if self._last is not None and self._last[0] == epoch:
            return self._last[1]
        generator = torch.Generator()
        start = 0
        if self._after is not None and self._after[0] < epoch:
            start, state = self._after[0] + 1, self._after[1]
        else:
            assert self.generator_state is not None, "a shuffling order needs its state"
            state = self.generator_state
        generator.set_state(state)
        drawing = RandomSampler(theirs.data_source, replacement=theirs.replacement,
                                num_samples=theirs.num_samples, generator=generator)
        for _ in range(start, epoch):  # the epochs before, drawn and thrown away
            for _ in drawing:
                pass
        order = [int(i) for i in drawing]
        self._after = (epoch, generator.get_state())
        self._last = (epoch, order)
        return order


def accelerate_generator_state(sampler: RandomSampler) -> torch.Tensor:
    """The generator state a shuffling loader starts from under Accelerate's
    ``prepare`` on several ranks: the sampler's own generator as it stands, else a new
    generator seeded with a number drawn from torch's random state now (Accelerate
    draws it so at ``prepare``; a script seeded alike draws the same on every rank)."""
    if sampler.generator is not None:
        return sampler.generator.get_state()
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    return torch.Generator().manual_seed(seed).get_state()


def _rounds(batches: list[list[int]], world_size: int, batch_size: int
            ) -> tuple[int, list[list[int]]]:
    """The whole rounds of ``batches`` (``world_size`` batches, the last of them full)
    and the batches after them."""
    rounds = len(batches) // world_size
    if rounds and len(batches[rounds * world_size - 1]) < batch_size:
        rounds -= 1  # (only an epoch's last batch is short)
    return rounds, batches[rounds * world_size:]


def _deal(batches: list[list[int]], world_size: int, rank: int, batch_size: int,
          drop_last: bool) -> list[list[int]]:
    """Rank ``rank``'s batches: batch ``i`` to rank ``i % world_size``, whole rounds
    only; without ``drop_last`` the last round is completed (its short batch filled up,
    missing batches made) from the epoch's first samples, cycled."""
    ws, b = world_size, batch_size
    rounds, rest = _rounds(batches, ws, b)
    out = [list(batches[k * ws + rank]) for k in range(rounds)]
    if drop_last or not rest:
        return out
    first = [i for batch in batches[:ws] for i in batch]
    while len(first) < ws * b:
        first += first
    cycle = 0
    for slot in range(ws):  # the last round: what is there, completed from `first`
        batch = list(rest[slot]) if slot < len(rest) else []
        need = b - len(batch)
        batch += first[cycle:cycle + need]
        cycle += need
        if slot == rank:
            out.append(batch)
    return out
