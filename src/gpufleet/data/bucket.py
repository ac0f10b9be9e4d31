"""Length-bucketed batches under a token budget, sharded over ranks and resumable.

Variable-length samples batched at random waste most of each padded batch on padding
(a long-tailed length distribution puts one long sample in nearly every batch).
``BucketBatchSampler`` shuffles the samples, sorts them by length inside large buffers,
packs neighbours of similar length into batches that fit a token budget, and shuffles
the batches again, so padding is small while lengths stay mixed across steps.
``pad_collate`` pads such a batch into one tensor; ``padded_waste`` measures the result.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Sampler

from gpufleet.data.passes import EpochPasses, check_int, check_shard

log = logging.getLogger(__name__)

UNEVEN_MODES = ("repeat", "drop")


def _as_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"lengths: got an array of shape {arr.shape} and dtype {arr.dtype}; "
                         "pass a 1-D sequence of integer token counts, one per sample.")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 1:
        bad = int(np.argmax(arr < 1))
        raise ValueError(f"lengths[{bad}] = {arr[bad]}: every sample needs at least one "
                         "token; filter empty samples out of the dataset first.")
    return arr


class BucketBatchSampler(EpochPasses, Sampler[list[int]]):
    """Yields batches of sample indices of similar length that fit a token budget.

    Use it as a DataLoader's ``batch_sampler`` (with ``pad_collate`` or your own
    collate). One epoch, computed identically on every rank:

    1. Samples longer than ``max_len`` or than ``token_budget`` (they fit no batch) are
       left out of every epoch. They are counted in ``overlong`` and listed in
       ``overlong_indices``, and a warning says so once, at construction.
    2. The remaining indices are shuffled with a generator seeded with ``seed + epoch``.
    3. The shuffled order is cut into sort buffers. **Buffer size**: a buffer is a run of
       consecutive samples holding about ``sort_size * world_size * token_budget`` tokens,
       that is about ``sort_size`` batches for each rank. Larger buffers pad less; smaller
       ones keep the order more random.
    4. Each buffer is sorted by length (stable) and packed greedily: a batch takes the
       next sample while ``longest * count <= token_budget`` and, when ``max_samples`` is
       set, ``count <= max_samples``. Batches never span two buffers.
    5. The order of all batches is shuffled with the same generator, so long and short
       batches are mixed across steps.
    6. **Fill rule**: the batch count is made a multiple of ``world_size``. With
       ``uneven="repeat"`` the list is extended by repeating batches from its start
       (several times over if there are fewer batches than ranks), so every rank gets at
       least one batch whenever one sample fits; with ``uneven="drop"`` the last
       ``count % world_size`` batches are dropped this epoch, so ranks may get none.
       Rank ``r`` then takes batches ``r, r + world_size, r + 2 * world_size, ...``.

    With ``shuffle=False`` steps 2 and 5 keep index order instead. The number of batches
    depends on how the shuffle packs, so ``len(self)`` can differ a little from one epoch
    to the next; it is the same on every rank within an epoch.

    Epochs and resuming work as in ``ResumableDistributedSampler``: iterating a pass to the
    end moves to the next epoch; ``set_epoch`` jumps to one; a new ``iter()`` continues
    after the last batch yielded; ``state_dict(consumed_batches=...)`` records the batches
    training consumed so a new sampler resumes at the next one.

    Args:
        lengths: token count of every sample of the dataset, in dataset order (>= 1).
        token_budget: the most padded tokens in one batch (longest sample x count).
        max_samples: the most samples in one batch; 0 for no cap.
        max_len: samples longer than this are left out; 0 for no limit besides the budget.
        sort_size: sort buffer size, in batches per rank (see step 3).
        rank: this process's rank, from 0 to ``world_size - 1``.
        world_size: number of ranks the batches are dealt to.
        seed: base seed; epoch ``e`` uses ``seed + e``.
        shuffle: shuffle samples and batches (training); ``False`` keeps index order.
        uneven: ``"repeat"`` or ``"drop"``: how to even out the batch count (step 6).

    Example:
        >>> lengths = [5, 3, 8, 2, 7, 4]
        >>> s = BucketBatchSampler(lengths, token_budget=16, rank=0, world_size=2)
        >>> batches = list(s)  # epoch 0 for rank 0; the next list(s) is epoch 1
        >>> all(max(lengths[i] for i in b) * len(b) <= 16 for b in batches)
        True
        >>> DataLoader(dataset, batch_sampler=s, collate_fn=pad_collate)  # doctest: +SKIP
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, *, token_budget: int,
                 max_samples: int = 0, max_len: int = 0, sort_size: int = 100,
                 rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True,
                 uneven: str = "repeat") -> None:
        super().__init__()
        check_int("token_budget", token_budget, 1)
        check_int("max_samples", max_samples, 0)
        check_int("max_len", max_len, 0)
        check_int("sort_size", sort_size, 1)
        check_shard(rank, world_size, seed)
        if uneven not in UNEVEN_MODES:
            choices = difflib.get_close_matches(str(uneven), UNEVEN_MODES, n=2, cutoff=0)
            raise ValueError(f"uneven = {uneven!r}: choose one of {', '.join(map(repr, choices))}.")
        self.lengths = _as_lengths(lengths)
        self.token_budget = token_budget
        self.max_samples = max_samples
        self.max_len = max_len
        self.sort_size = sort_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.uneven = uneven

        limit = min(max_len, token_budget) if max_len else token_budget
        too_long = self.lengths > limit
        self.overlong_indices: list[int] = np.flatnonzero(too_long).tolist()
        self.overlong = len(self.overlong_indices)  # samples left out of every epoch
        self._eligible = np.flatnonzero(~too_long)
        if self.overlong:
            log.warning("BucketBatchSampler: %d of %d samples are longer than %d tokens "
                        "(max_len = %d, token_budget = %d) and are left out of every epoch; "
                        "their indices are in sampler.overlong_indices.",
                        self.overlong, len(self.lengths), limit, max_len, token_budget)

        self._init_passes()
        self._cache: tuple[int, list[list[int]]] | None = None  # (epoch, all ranks' batches)
        self._real = (-1, 0)  # (epoch, its batches before the fill rule)

    @property
    def dataset_len(self) -> int:
        """Number of samples in the dataset, over-long ones included."""
        return len(self.lengths)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All ranks' batches of ``epoch`` after the fill rule; rank r takes ``[r::W]``.

        Example:
            >>> s = BucketBatchSampler([1, 2, 3], token_budget=4, shuffle=False)
            >>> s.epoch_batches(0)
            [[0, 1], [2]]
        """
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        order = self._eligible
        if self.shuffle:
            order = order[torch.randperm(len(order), generator=g).numpy()]
        batches = self._pack(order)
        if self.shuffle and batches:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        n, ws = len(batches), self.world_size
        if self.uneven == "drop":
            batches = batches[:n - n % ws]
        elif n % ws:
            pad = ws - n % ws  # may exceed n when there are fewer batches than ranks
            batches = batches + (batches * math.ceil(pad / n))[:pad]
        assert len(batches) % ws == 0
        self._cache = (epoch, batches)
        self._real = (epoch, n if self.uneven == "repeat" else len(batches))
        return batches

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        """Cuts ``order`` into sort buffers, sorts each by length and packs it greedily."""
        lens = self.lengths[order]
        buffer_tokens = self.sort_size * self.world_size * self.token_budget
        buffer_id = (np.cumsum(lens) - lens) // buffer_tokens  # tokens before each sample
        # One stable sort by (buffer, length) sorts every buffer in place.
        key = buffer_id * (int(lens.max(initial=0)) + 1) + lens
        perm = np.argsort(key, kind="stable")
        order, lens, buffer_id = order[perm].tolist(), lens[perm].tolist(), buffer_id[perm]
        cap = self.max_samples or len(order)
        batches: list[list[int]] = []
        current: list[int] = []
        current_buffer = -1
        for index, length, buf in zip(order, lens, buffer_id.tolist()):
            # Sorted ascending within a buffer, so `length` is the batch's longest sample.
            if current and (buf != current_buffer or len(current) >= cap
                            or length * (len(current) + 1) > self.token_budget):
                batches.append(current)
                current = []
            current.append(index)
            current_buffer = buf
        if current:
            batches.append(current)
        return batches

    def real_batches(self, epoch: int) -> int:
        """Batches of ``epoch`` before the fill rule: the positions of
        :meth:`epoch_batches` from this one on repeat earlier batches."""
        self.epoch_batches(epoch)  # cached: it sets the count for its epoch
        return self._real[1]

    def ledger_segment(self, epoch: int) -> dict[str, Any]:
        """What the data ledger records of ``epoch`` before this rank reads from it (the
        batches are recomputed from the lengths and these settings).

        Example:
            >>> BucketBatchSampler([1, 2, 3], token_budget=4).ledger_segment(0)["items"]
            2
        """
        return {"kind": "bucket", "epoch": epoch, "seed": self.seed, "shard": self.rank,
                "world": self.world_size, "skip": 0, "items": self._count(epoch),
                **{k: v for k, v in self._config().items() if k != "world_size"}}

    def rank_batches(self, epoch: int) -> list[list[int]]:
        """The batches this rank yields in ``epoch``, in order."""
        return self.epoch_batches(epoch)[self.rank::self.world_size]

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (the same on every rank)."""
        return len(self.epoch_batches(self.epoch)) // self.world_size

    def __iter__(self) -> Iterator[list[int]]:
        return self._start_pass()

    def _items(self, epoch: int) -> list[list[int]]:
        return self.rank_batches(epoch)

    def _emit(self, live: Iterator[list[int]]) -> Iterator[list[int]]:
        return map(list, live)  # copies: the cached epoch must not change under the caller

    def _config(self) -> dict[str, Any]:
        return {"dataset_len": self.dataset_len, "world_size": self.world_size,
                "token_budget": self.token_budget, "max_samples": self.max_samples,
                "max_len": self.max_len, "sort_size": self.sort_size,
                "shuffle": self.shuffle, "uneven": self.uneven}

    def state_dict(self, consumed_batches: int | None = None) -> dict[str, Any]:
        """The position to resume from.

        Args:
            consumed_batches: batches of this rank that training has consumed in the epoch
                of the pass most recently started, counted from the start of that epoch.
                Give it when a DataLoader prefetches; ``None`` records the sampler's own
                count (where the next ``iter()`` starts).

        Returns:
            ``{"epoch", "position", "seed"}`` plus the settings that shape the batches
            (dataset length, world size, budget, ...), which ``load_state_dict`` checks.

        Example:
            >>> s = BucketBatchSampler([3] * 10, token_budget=6)
            >>> s.state_dict(consumed_batches=2)["position"]
            2
        """
        epoch, position = self._saved_position(consumed_batches, "consumed_batches")
        return {"epoch": epoch, "position": position, "seed": self.seed, **self._config()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue right after ``state``'s position.

        The saved seed is taken over, so the batches are the ones the saved run used.

        Raises:
            ValueError: the state was saved for a different dataset length, world size or
                packing setting (the batches would differ), or its position is out of range.

        Example:
            >>> a = BucketBatchSampler([3] * 10, token_budget=6)
            >>> b = BucketBatchSampler([3] * 10, token_budget=6)
            >>> b.load_state_dict(a.state_dict(consumed_batches=1))
        """
        for key, value in self._config().items():
            if key in state and state[key] != value:
                raise ValueError(
                    f"sampler state was saved with {key} = {state[key]!r}, but this sampler "
                    f"has {key} = {value!r}. Resume with the same data, rank count and "
                    "batching settings, or call set_epoch() to restart the epoch instead.")
        if state["seed"] != self.seed:
            log.info("sampler: using the saved seed %d instead of %d to resume the same order",
                     state["seed"], self.seed)
            self.seed, self._cache = state["seed"], None
        self._restore_position(state["epoch"], state["position"])


def padded_waste(lengths: Sequence[int] | np.ndarray, batches: Sequence[Sequence[int]]) -> float:
    """Fraction of padded tokens: ``1 - real / sum(longest_in_batch * batch_size)``.

    Args:
        lengths: token count of every sample, indexed like the batches.
        batches: lists of sample indices (e.g. ``list(sampler)``).

    Returns:
        0.0 for no padding (or no tokens at all), up to just below 1.0.

    Example:
        >>> padded_waste([2, 6, 4], [[0, 1], [2]])
        0.25
    """
    lens = np.asarray(lengths, dtype=np.int64)
    real = padded = 0
    for batch in batches:
        if len(batch):
            batch_lens = lens[np.asarray(batch, dtype=np.int64)]
            real += int(batch_lens.sum())
            padded += int(batch_lens.max()) * len(batch)
    return 1.0 - real / padded if padded else 0.0


def pad_collate(batch: Sequence[Any], pad_value: int = 0) -> torch.Tensor | tuple[
        torch.Tensor, torch.Tensor]:
    """Pads 1-D integer sequences into a ``[B, T]`` LongTensor, ``T`` the longest.

    Items are token sequences (tensors or lists of ints), or ``(tokens, label)`` tuples;
    with pairs the labels are stacked into one tensor and returned second.

    Args:
        batch: the samples of one batch, as a DataLoader hands them to ``collate_fn``.
        pad_value: token written after the end of shorter sequences.

    Returns:
        ``tokens`` of shape ``[B, T]``, or ``(tokens, labels)`` for pairs.

    Example:
        >>> pad_collate([torch.tensor([1, 2, 3]), torch.tensor([4])])
        tensor([[1, 2, 3],
                [4, 0, 0]])
        >>> loader = DataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate)  # doctest: +SKIP
    """
    if len(batch) == 0:
        raise ValueError("pad_collate got an empty batch; a batch needs at least one sample.")
    pairs = isinstance(batch[0], tuple)
    seqs = [item[0] if pairs else item for item in batch]
    tokens = []
    for i, seq in enumerate(seqs):
        t = torch.as_tensor(seq)
        if t.ndim != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"pad_collate: sample {i} has shape {tuple(t.shape)} and dtype "
                             f"{t.dtype}; each sample must be a 1-D sequence of integer tokens.")
        tokens.append(t.long())
    padded = pad_sequence(tokens, batch_first=True, padding_value=pad_value)
    if not pairs:
        return padded
    labels = torch.stack([torch.as_tensor(item[1]) for item in batch])
    return padded, labels
