"""A distributed sampler that moves through epochs by itself and resumes mid-epoch.

Like ``torch.utils.data.DistributedSampler``, every rank draws the same permutation and
takes every ``world_size``-th index of it. Unlike it, the epoch advances when a pass is
iterated to the end, and ``state_dict``/``load_state_dict`` restore the exact position
inside an epoch, so a resumed run sees the samples the uninterrupted run would have seen.

The saved position is global: the number of samples of the epoch's permutation that all
ranks together have consumed. Rank ``r`` of ``w`` takes ``order[r::w]``, so after ``p``
samples per rank exactly ``order[:p * w]`` are done, whatever ``w`` is. A run resumed at
another world size (a node lost or back, another ``--nproc``) shards the rest,
``order[p * w:]``, over its own ranks: every sample of the epoch is read once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from gpufleet.data.passes import EpochPasses, check_int, check_shard

log = logging.getLogger(__name__)


class ResumableDistributedSampler(EpochPasses, Sampler[int]):
    """Shards dataset indices over ranks; resumable at any sample.

    Training mode (the default): each epoch draws a permutation from a generator seeded
    with ``seed + epoch`` (identical on every rank; ``shuffle=False`` keeps ``0..n-1``).
    With ``draw_seeds`` and one rank, the seed is drawn from torch's random state when
    the epoch is first read, as torch's ``RandomSampler`` draws one per pass, so a
    one-process loop keeps the order its ``DataLoader(shuffle=True)`` had; the drawn
    seed is saved with the position.
    With ``source`` (a sampler of the caller's own: weighted, a subset, a generator of
    its own), each epoch's order is what ``source`` yields when the epoch is first read,
    sharded as below (as Lightning's ``DistributedSamplerWrapper`` shards it);
    ``dataset_len`` is then ``len(source)``, and the order of the epoch being read is
    saved with the position.
    It is padded by repeating indices from its start until its length divides
    ``world_size`` (or truncated to a multiple with ``drop_last``), and rank ``r`` takes
    ``indices[r::world_size]``, so every rank yields ``len(self)`` indices per epoch.

    Evaluation mode (``eval_mode=True``): no shuffle, no padding; rank ``r`` takes
    ``range(r, n, world_size)``, so over all ranks every sample is seen exactly once and
    sums reduced across ranks count each sample once. Ranks may then yield different
    numbers of indices (they differ by at most one). Every ``iter()`` is one complete pass
    from the start (an evaluation cut short does not shift the next one); no position is
    tracked.

    Epochs: iterating a training pass to the end moves to the next epoch; ``set_epoch``
    jumps to one. A new ``iter()`` continues the current epoch after the last index
    yielded (so an abandoned pass resumes, and a loaded state resumes). Change the state
    (``set_epoch``, ``load_state_dict``) only between passes.

    World-size changes: ``load_state_dict`` accepts a state saved at any world size; the
    rest of that epoch is split over this sampler's ranks (padding only at its end).

    Checkpoints and DataLoader prefetch: a DataLoader draws indices ahead of the batches
    training has consumed, so the sampler's own count runs ahead. Count the samples this
    rank consumed in the current epoch yourself and save ``state_dict(consumed=count)``;
    the state then names the epoch of the pass being consumed and that position, even if
    the sampler itself has already run out and moved on to the next epoch.

    Example:
        >>> s = ResumableDistributedSampler(10, rank=1, world_size=4, seed=0)
        >>> len(s), len(list(s))
        (3, 3)
        >>> it = iter(s); first = [next(it), next(it)]
        >>> state = s.state_dict(consumed=2)
        >>> resumed = ResumableDistributedSampler(10, rank=1, world_size=4, seed=0)
        >>> resumed.load_state_dict(state)
        >>> list(resumed) == list(it)
        True
    """

    def __init__(self, dataset_len: int, *, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 eval_mode: bool = False, draw_seeds: bool = False,
                 source: Sampler | None = None) -> None:
        super().__init__()
        check_int("dataset_len", dataset_len, 0)
        check_shard(rank, world_size, seed)
        self.dataset_len = dataset_len
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.eval_mode = eval_mode
        self.draw_seeds = draw_seeds and shuffle and world_size == 1
        # (epoch, samples): that epoch starts after its first `samples` permuted indices,
        # which ranks of an earlier run (of any world size) already consumed.
        self._offset = (0, 0)
        self._drawn: dict[int, int] = {}  # epoch -> the seed its permutation came from
        self.source = source
        self._orders: dict[int, list[int]] = {}  # epoch -> what `source` yielded for it
        self._init_passes()

    def __len__(self) -> int:
        """Indices this rank yields in one full epoch (or one evaluation pass)."""
        return self._share(self.dataset_len)

    def _share(self, left: int) -> int:
        """This rank's indices when ``left`` samples of an epoch remain to be read."""
        ws = self.world_size
        if self.eval_mode:
            return len(range(self.rank, self.dataset_len, ws))
        return left // ws if self.drop_last else math.ceil(left / ws)

    def _skipped(self, epoch: int) -> int:
        """Samples of ``epoch`` that an earlier run consumed before this one took over."""
        return self._offset[1] if self._offset[0] == epoch else 0

    def rank_indices(self, epoch: int) -> list[int]:
        """All indices this rank yields in ``epoch``, in order.

        Example:
            >>> ResumableDistributedSampler(5, rank=1, world_size=2, shuffle=False).rank_indices(0)
            [1, 3, 0]
        """
        n, ws = self.dataset_len, self.world_size
        if self.eval_mode:
            return list(range(self.rank, n, ws))
        if self.source is not None:
            order = self._source_order(epoch)
        elif self.shuffle:
            g = torch.Generator()
            g.manual_seed(self._epoch_seed(epoch))
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        rest = order[self._skipped(epoch):]
        left = len(rest)
        if self.drop_last:
            rest = rest[:left - left % ws]
        elif left % ws:
            pad = ws - left % ws  # may exceed n when n < world_size: repeat as often as needed
            rest += (order * math.ceil(pad / max(1, n)))[:pad]
        return rest[self.rank::ws]

    def ledger_segment(self, epoch: int) -> dict[str, Any]:
        """What the data ledger records of ``epoch`` before this rank reads from it: the
        order's identity (kind, seed, length), the samples an earlier run consumed
        (``skip``), the shard and this rank's items; enough to recompute every index.

        Example:
            >>> ResumableDistributedSampler(6, rank=1, world_size=2).ledger_segment(0)["items"]
            3
        """
        kind = "source" if self.source is not None else "perm" if self.shuffle else "range"
        seed = self._drawn.get(epoch, None if self.draw_seeds else self.seed + epoch)
        return {"kind": kind, "epoch": epoch, "n": self.dataset_len, "seed": seed,
                "skip": self._skipped(epoch), "world": self.world_size, "shard": self.rank,
                "pad": not self.drop_last, "items": self._count(epoch)}

    def _epoch_seed(self, epoch: int) -> int:
        """The seed of ``epoch``'s permutation: ``seed + epoch``, or with ``draw_seeds``
        one drawn from torch's random state when the epoch is first read, as
        ``RandomSampler`` draws one for each pass (kept: a resumed epoch reuses it)."""
        if epoch in self._drawn:
            return self._drawn[epoch]
        if not self.draw_seeds:
            return self.seed + epoch
        drawn = int(torch.empty((), dtype=torch.int64).random_().item())
        self._drawn = {epoch: drawn}  # earlier epochs are done with
        return drawn

    def _source_order(self, epoch: int) -> list[int]:
        """``epoch``'s order as ``source`` yields it, drawn when the epoch is first read
        (as a DataLoader iterates its sampler at a pass's first batch); kept, so a
        resumed epoch reuses it."""
        if epoch not in self._orders:
            set_epoch = getattr(self.source, "set_epoch", None)
            if callable(set_epoch):  # a source whose order is the epoch's (as
                set_epoch(epoch)  # DistributedSampler's is) is told which one
            order = [int(i) for i in self.source]  # type: ignore[union-attr]
            if len(order) != self.dataset_len:
                raise ValueError(f"the sampler yielded {len(order)} indices in an epoch, "
                                 f"but its len() is {self.dataset_len}.")
            self._orders = {epoch: order}  # earlier epochs are done with
        return self._orders[epoch]

    def __iter__(self) -> Iterator[int]:
        if self.eval_mode:
            return iter(self.rank_indices(0))
        return self._start_pass()

    def _items(self, epoch: int) -> list[int]:
        return self.rank_indices(epoch)

    def _count(self, epoch: int) -> int:
        """This rank's indices in ``epoch``, counted without drawing its order."""
        return self._share(self.dataset_len - self._skipped(epoch))

    def state_dict(self, consumed: int | None = None) -> dict[str, int]:
        """The position to resume from, as samples of the epoch consumed by all ranks.

        Args:
            consumed: indices of this rank that training has consumed in the epoch of the
                pass most recently started, counted from the start of that epoch (a
                resumed pass counts the skipped ones too). Give it when a DataLoader
                prefetches; ``None`` records the sampler's own count (the next ``iter()``).

        Returns:
            ``{"epoch", "samples", "seed", "world_size", "dataset_len"}``: ``samples`` is
            the global position (the first ``samples`` indices of the epoch's
            permutation are done); ``world_size`` is informational. An epoch whose
            order was drawn adds ``epoch_seed`` (``draw_seeds``) or ``epoch_order``
            (``source``).

        Example:
            >>> s = ResumableDistributedSampler(8, world_size=2)
            >>> s.state_dict(consumed=3)["samples"]
            6
        """
        epoch, position = self._saved_position(consumed, "consumed")
        samples = min(self.dataset_len, self._skipped(epoch) + position * self.world_size)
        state = {"epoch": epoch, "samples": samples, "seed": self.seed,
                 "world_size": self.world_size, "dataset_len": self.dataset_len}
        if epoch in self._drawn:  # the epoch's permutation came from a drawn seed
            state["epoch_seed"] = self._drawn[epoch]
        if epoch in self._orders:  # the epoch's order came from the source sampler
            state["epoch_order"] = torch.tensor(self._orders[epoch], dtype=torch.int64)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue right after ``state``'s position.

        The saved seed is taken over, so the permutation is the one the saved run used.
        The state may come from another world size: the rest of its epoch is split over
        this sampler's ranks. (A state of the older per-rank form, with ``position``
        instead of ``samples``, needs the world size it was saved with.)

        Raises:
            ValueError: the state was saved for a different dataset length (or, in the
                older form, world size), or its position is out of range.

        Example:
            >>> a = ResumableDistributedSampler(8, world_size=2)
            >>> b = ResumableDistributedSampler(8, world_size=3)
            >>> b.load_state_dict(a.state_dict(consumed=1))  # 2 of 8 done; 6 left for 3
            >>> len(list(b))
            2
        """
        keys = ("dataset_len",) if "samples" in state else ("dataset_len", "world_size")
        for key in keys:
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key} = {state[key]}, but this sampler "
                    f"has {key} = {getattr(self, key)}. Resume with the same data and rank "
                    "count, or call set_epoch() to restart the epoch instead.")
        samples = state["samples"] if "samples" in state else self._old_position(state)
        epoch = state["epoch"]
        if not isinstance(samples, int) or not 0 <= samples <= self.dataset_len:
            raise ValueError(f"sampler state samples = {samples!r} (position): must be "
                             f"from 0 to {self.dataset_len}, the samples of an epoch.")
        if state["seed"] != self.seed:
            log.info("sampler: using the saved seed %d instead of %d to resume the same order",
                     state["seed"], self.seed)
        self.seed = state["seed"]
        # A drawn seed is taken over for its epoch (at any world size); the epochs after
        # it follow this sampler's own rule.
        self._drawn = {epoch: state["epoch_seed"]} if "epoch_seed" in state else {}
        self._orders = {epoch: self._saved_order(state["epoch_order"])} \
            if "epoch_order" in state else {}
        self._offset = (epoch, samples)
        self._restore_position(epoch, 0)

    def _saved_order(self, saved: Any) -> list[int]:
        """A saved ``epoch_order``: ``dataset_len`` whole indices, or a ValueError that
        says the state is not one this sampler wrote."""
        try:
            order = torch.as_tensor(saved)
        except (TypeError, ValueError, RuntimeError):
            order = None
        if order is None or order.dim() != 1 or len(order) != self.dataset_len or \
                order.is_floating_point() or order.is_complex() or \
                (len(order) and int(order.min()) < 0):
            raise ValueError(f"sampler state epoch_order is not {self.dataset_len} indices "
                             "of the epoch's order (a damaged or foreign checkpoint): "
                             "resume from another checkpoint, or call set_epoch() to "
                             "restart the epoch instead.")
        return order.tolist()

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at the beginning of ``epoch`` (all of its samples)."""
        self._offset = (0, 0)
        super().set_epoch(epoch)

    def _old_position(self, state: dict[str, Any]) -> int:
        """Global samples of a per-rank ``position`` (states saved before ``samples``)."""
        position = state.get("position")
        if not isinstance(position, int) or not 0 <= position <= len(self):
            raise ValueError(f"sampler state position = {position!r}: must be from 0 to "
                             f"{len(self)} (this rank's items in an epoch).")
        return min(self.dataset_len, position * self.world_size)
