"""StreamShard (gpufleet.data.stream_shard): a stream shared out over ranks and loader
workers, every item once, and a position that resumes at other worker and rank counts.
In process: each (rank, worker) reader is the shard's own read of its share."""

from __future__ import annotations

import logging

import pytest
from torch.utils.data import IterableDataset

from gpufleet.data.loaders import stream_loader
from gpufleet.data.stream_shard import StreamShard
from gpufleet.errors import ConfigError


class Count(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(100 * self.epoch, 100 * self.epoch + self.n))


def _batches(share: StreamShard, workers: int) -> list[list[int]]:
    """The batches the rank's loader hands out: its workers' batches in turn."""
    per_worker = []
    for w in range(workers):
        items = list(share._read(w, workers, announce=w == 0 and share.rank == 0))
        per_worker.append([items[i:i + share.unit] for i in range(0, len(items), share.unit)])
    out = []
    for j in range(max(map(len, per_worker))):
        out += [b[j] for b in per_worker if j < len(b)]  # round robin, in order
    return out


@pytest.mark.parametrize("world, workers", [(1, 1), (1, 3), (2, 1), (2, 2), (3, 2)])
def test_every_item_is_read_once_in_the_order_of_the_ranks(world, workers, caplog):
    n, unit = 47, 4
    shares = [StreamShard(Count(n), unit=unit, rank=r, world_size=world) for r in range(world)]
    with caplog.at_level(logging.WARNING):
        batches = [_batches(s, workers) for s in shares]
    # the j-th batch of rank k is chunk k of row j, whatever the number of workers
    assert all(b[0] == list(range(k * unit, (k + 1) * unit)) for k, b in enumerate(batches))
    assert len({len(b) for b in batches}) == 1  # every rank as many batches
    read = sorted(x for b in batches for batch in b for x in batch)
    kept = n if world == 1 else n // (unit * world) * unit * world
    assert read == list(range(kept))
    if world > 1:  # what is left out is said
        assert f"the last {n - kept} item(s) of epoch 0 are left out" in caplog.text


def test_a_position_resumes_at_other_worker_and_rank_counts():
    unit, n = 2, 44  # 12 read by 2 ranks, then 4 rows of 4 ranks x 2
    before = [StreamShard(Count(n), unit=unit, rank=r, world_size=2) for r in (0, 1)]
    first = [_batches(s, 2)[:3] for s in before]  # 3 batches a rank read
    state = before[0].state_dict(consumed=3 * unit)
    assert state == before[1].state_dict(consumed=3 * unit)  # the same on both ranks
    assert state["samples"] == 12
    after = [StreamShard(Count(n), unit=unit, rank=r, world_size=4) for r in range(4)]
    for share in after:
        share.load_state_dict(state)
    rest = [_batches(s, 3) for s in after]
    read = sorted(x for b in first + rest for batch in b for x in batch)
    assert read == list(range(n))  # none twice, none missed


def test_epochs_and_wrong_positions():
    share = StreamShard(Count(6), unit=2, rank=0, world_size=1)
    share.set_epoch(2)
    assert list(share) == [200, 201, 202, 203, 204, 205]  # the source was told its epoch
    with pytest.raises(ValueError, match="batches of 4"):
        share.load_state_dict({"epoch": 0, "samples": 8, "unit": 4})
    with pytest.raises(ValueError, match="map-style"):
        share.load_state_dict({"epoch": 0, "samples": 8, "seed": 0, "dataset_len": 9})


def test_a_hugging_face_stream_that_splits_itself_is_refused_naming_the_fix():
    """A Hugging Face IterableDataset gives each loader worker only its shards (2 workers
    read 20 of these 40 items), and split_dataset_by_node each rank only its part: the
    share's readers would lose items, so both are refused; read by the loop's own
    process, it is shared out whole."""
    datasets = pytest.importorskip("datasets")  # (an optional dependency: gpufleet[hf])
    from datasets.distributed import split_dataset_by_node

    stream = datasets.Dataset.from_dict({"x": list(range(40))}).to_iterable_dataset(4)
    share = StreamShard(stream, unit=4, rank=0, world_size=1)
    with pytest.raises(ConfigError, match=r"data\.num_workers=0 in fit"):
        stream_loader(share, batch_size=4, num_workers=2)
    read = [int(x) for batch in stream_loader(share, batch_size=4, num_workers=0)
            for x in batch["x"]]
    assert read == list(range(40))
    split = StreamShard(split_dataset_by_node(stream, rank=0, world_size=2), unit=4,
                        rank=0, world_size=2)
    with pytest.raises(ConfigError, match="split_dataset_by_node"):
        stream_loader(split, batch_size=4, num_workers=0)
