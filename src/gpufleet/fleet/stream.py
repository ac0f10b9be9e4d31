"""A loader over an ``IterableDataset``, shared out over the ranks and resumable:
:func:`shard_stream` and :class:`FleetStreamLoader`.

On several ranks :meth:`gpufleet.fleet.Fleet.setup_dataloaders` rebuilds a loader over a
stream around :class:`~gpufleet.data.stream_shard.StreamShard`: each rank, and each of
its loader's workers, reads its own chunks of the stream (a batch each), so every item
is read once by one rank, and :meth:`~gpufleet.fleet.Fleet.save` records the position
(the items every rank has read), which a resumed loop (at any number of workers or
ranks, with the same batch size) starts after. The workers are started for each pass
(not persistent): a pass's workers are handed the position it starts from.

Example:
    >>> # loader = fleet.setup_dataloaders(DataLoader(MyStream(), batch_size=8,
    >>> #                                             num_workers=2))
"""

from __future__ import annotations

from torch.utils.data import DataLoader, IterableDataset

from gpufleet.data.loaders import stream_loader
from gpufleet.data.stream_shard import StreamShard
from gpufleet.fleet.loader import _KEPT, FleetLoader


def shard_stream(loader: DataLoader, *, rank: int, world_size: int
                 ) -> tuple[DataLoader, StreamShard]:
    """``loader`` (over an ``IterableDataset``) rebuilt to read this rank's share of the
    stream, and that share (its position)."""
    assert isinstance(loader.dataset, IterableDataset), "shard_loader takes map-style data"
    share = StreamShard(loader.dataset, unit=loader.batch_size or 1, rank=rank,
                        world_size=world_size)
    kwargs = {k: getattr(loader, k) for k in _KEPT if hasattr(loader, k)}
    return stream_loader(share, **kwargs), share  # (as fit's: data/loaders.py)


class FleetStreamLoader(FleetLoader):
    """A :class:`~gpufleet.fleet.loader.FleetLoader` over a stream's share: where the
    pass ends is known once it ends (no length), and every item is a sample of the
    stream (no padding)."""

    sampler: StreamShard  # type: ignore[assignment]  # the share, its position

    def _leave(self, number: int, epoch: int) -> None:
        live = self._live
        super()._leave(number, epoch)
        # Read to its end: the next pass reads the next epoch (a map-style sampler moves
        # on by itself; the stream's end is seen here, in the loader's process).
        if live is not None and live[0] == number and self._ended:
            self.sampler.pass_ended(epoch)

    @property
    def at_last_batch(self) -> bool:
        """The pass has ended (a stream's last batch is known once it is read past)."""
        return self._ended

    def real_items(self, rank: int) -> int | None:
        """Every item of the last batch is a sample of the stream."""
        return self.last_batch[2] if self.last_batch is not None else None
