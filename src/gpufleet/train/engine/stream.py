"""The training batches, epoch after epoch, on the device: :class:`TrainStream`.

The stream owns the training loader and its resumable sampler. The loop asks it for the
next batch; epochs roll over by themselves, and the stream counts the samples and
tokens it handed out (from tensor shapes on the host: no device sync) for the next log
line.

Over an ``IterableDataset`` the "sampler" is the rank's
:class:`~gpufleet.data.stream_shard.StreamShard` (its position is saved the same way);
an epoch is a pass of the stream, counted when the pass is read past (its length is not
known before).
"""

from __future__ import annotations

from typing import Any

import torch

from gpufleet.core.tree import batch_size_of, to_device, tokens_of
from gpufleet.data.ledger import DataLedger
from gpufleet.data.loaders import TrainLoader
from gpufleet.data.prefetch import DevicePrefetcher
from gpufleet.train.perf import to_channels_last


class TrainStream:
    """Batches of the training set for this rank, and where in the data the run is.

    Args:
        train: the training loader and its sampler (:func:`~gpufleet.data.loaders.
            build_train_loader`).
        device: where batches go.
        seed / rank: seed the loader's worker seeds per (seed, rank, epoch).
        pin_memory: batches are pinned (CUDA copies may then overlap compute).
        device_prefetch: copy the next batch to the GPU on a side stream.
        channels_last: hand image batches over in channels-last memory format.
        data_copies: ranks that read each sample (pipeline stages read the same data).

    Attributes:
        sampler: the resumable sampler (the checkpointer saves its position).
        epoch: the epoch being read.
        consumed: what of it was taken: samples ("fixed" batches) or batches ("tokens").
        samples / tokens: handed out since :meth:`take_counts` last emptied them.
        ledger: records what each step consumed in the run directory (None: not kept).
    """

    def __init__(self, train: TrainLoader, device: torch.device, *, seed: int, rank: int,
                 pin_memory: bool, device_prefetch: bool, channels_last: bool,
                 data_copies: int) -> None:
        self._train, self.sampler = train, train.sampler
        self.device, self.pin_memory = device, pin_memory
        self._seed, self._rank = seed, rank
        self._device_prefetch, self._channels_last = device_prefetch, channels_last
        self.data_copies = data_copies
        self.unit = train.unit  # one "consumed" count per batch
        self._variable = train.variable
        self._stream = train.stream  # an IterableDataset: no length before a pass ends
        self._fixed_tokens: int | None = None  # tokens per batch when batches are fixed
        self.epoch, self.consumed = 0, 0
        self.samples, self.tokens = 0, 0
        self._batches: Any = None
        self._loader_it: Any = None  # the loader's own iterator under _batches
        self.ledger: DataLedger | None = None

    def start(self, epoch: int, consumed: int = 0) -> None:
        """Read from ``epoch`` on (the sampler already knows where in it: a resumed
        run's sampler skips what ``consumed`` counts)."""
        self._start(epoch, consumed, event=True)

    def _start(self, epoch: int, consumed: int, event: bool) -> None:
        self.epoch, self.consumed = epoch, consumed
        self._batches = self._epoch_iterator()
        if self.ledger is not None:  # the segment: enough to recompute every index
            segment = self.sampler.ledger_segment(epoch)
            segment["reads"] = None if self._stream else \
                segment["items"] // self.unit * self.unit  # drop_last
            self.ledger.begin(segment, consumed // self.unit * self.unit, event=event,
                              world=self.data_copies * self.sampler.world_size,
                              rank=self._rank)

    def reshard(self, rank: int, shard: int, shards: int, data_copies: int) -> None:
        """This rank (``rank``) reads shard ``shard`` of ``shards`` from now on, each
        sample read by ``data_copies`` ranks: the ranks regrouped at another world size
        in process. Restore the sampler's position and call :meth:`start` next."""
        self._train.reshard(shard, shards)
        self._rank, self.data_copies = rank, data_copies
        self._batches = None  # persistent workers stay, for the next pass

    def close(self) -> None:
        """Stop the loader's worker processes now, with what they prefetched (pinned
        batches too). A run stops mid-epoch, and its iterator would otherwise keep its
        workers until the garbage collector or the interpreter's exit reaches it: each
        ``fit`` of a process (a sweep, a notebook) added a loader's workers and memory.
        The next :meth:`start` begins a fresh pass."""
        if self.ledger is not None:
            self.ledger.close()
        it, self._loader_it, self._batches = self._loader_it, None, None
        # What torch's own iterator does when it is freed or runs out (persistent workers
        # too: the loader is this run's).
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        if getattr(self._train.loader, "_iterator", None) is it:
            self._train.loader._iterator = None

    def next(self) -> Any:
        """The next training batch on the device."""
        batch = next(self._batches, None)
        if batch is None:  # end of epoch: the sampler has moved on to the next one
            if self._stream:  # (a stream's share learns it here: its reader saw the end)
                self.sampler.pass_ended(self.epoch)
            self._start(self.epoch + 1, 0, event=False)
            batch = next(self._batches)
        self.consumed += self.unit
        if self.ledger is not None:  # a few stores into a memory-mapped file
            self.ledger.take(self.unit)
        if self._variable:
            self.samples += batch_size_of(batch)
            self.tokens += tokens_of(batch) or 0  # padding included
        else:  # drop_last=True: every batch holds exactly data.batch_size samples
            if self._fixed_tokens is None:
                self._fixed_tokens = tokens_of(batch) or 0
            self.samples += self.unit
            self.tokens += self._fixed_tokens
        if self._channels_last:
            return to_channels_last(batch)
        return batch

    def take_counts(self) -> tuple[int, int]:
        """Samples and tokens handed out since the last call (this rank's)."""
        counts = (self.samples, self.tokens)
        self.samples, self.tokens = 0, 0
        return counts

    def batches_in_epoch(self, epoch: int) -> int:
        """Batches this rank reads in ``epoch``."""
        return self._train.batches_in_epoch(epoch)

    def steps_to_epoch_end(self, accum: int) -> int:
        """Optimizer steps of ``accum`` batches until the epoch being read ends (the
        next epoch's end when this one just did); 1 on a stream, whose pass's end is
        seen when it is read past (an epoch's checkpoint then follows the step that did)."""
        if self._stream:
            return 1
        left = self.batches_in_epoch(self.epoch) - self.consumed // self.unit
        if left <= 0:
            left = self.batches_in_epoch(self.epoch + 1)
        return max(1, -(-left // accum))

    @property
    def epochs_done(self) -> float:
        """Passes over the training set so far, e.g. 1.5 halfway through the second; on a
        stream the passes ended (whole: its length is not known)."""
        if self._stream:
            return float(self.epoch)
        per_epoch = self.batches_in_epoch(self.epoch) * self.unit
        return self.epoch + (self.consumed / per_epoch if per_epoch else 0.0)

    def _epoch_iterator(self) -> Any:
        """A fresh pass over the training loader for ``self.epoch``.

        The loader draws its workers' base seed from its own generator, seeded from
        (seed, rank, epoch), not from the global RNG: a resumed run then restores the
        global RNG exactly and its workers get the seeds the uninterrupted run's got.
        """
        loader = self._train.loader
        loader.generator.manual_seed(self._seed * 1_000_003 + self._rank * 7919 + self.epoch)
        self._loader_it = batches = iter(loader)
        if self.device.type != "cuda":  # the loader already made the tensors
            return batches
        if self._device_prefetch:
            # Copy the next batch to the GPU on a side stream while this step computes.
            return iter(DevicePrefetcher(batches, self.device))
        # The copy runs on the compute stream when the batch is taken (data.device_prefetch
        # off: for comparison, or to rule the prefetcher out when hunting a bug).
        return (to_device(b, self.device, non_blocking=self.pin_memory) for b in batches)
