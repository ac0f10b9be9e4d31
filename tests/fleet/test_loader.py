"""FleetLoader: a loader sharded like torch's DistributedSampler, whose saved position
resumes at the exact sample (mid-epoch, at a pass's last batch, after a pass)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from gpufleet.errors import ConfigError
from gpufleet.fleet.loader import FleetLoader, shard_loader

DATA = TensorDataset(torch.arange(30).float().unsqueeze(1))


def _fleet_loader(rank: int = 0, world: int = 1, shuffle: bool = True) -> FleetLoader:
    loader, sampler = shard_loader(DataLoader(DATA, batch_size=4, shuffle=shuffle),
                                   rank=rank, world_size=world, seed=3)
    return FleetLoader(loader, sampler, on_batch=lambda: None)


def _ids(batches) -> list[int]:
    return [int(v) for (x,) in batches for v in x.flatten()]


@pytest.mark.parametrize("world", [1, 3])
def test_shards_like_torchs_distributed_sampler(world):
    for rank in range(world):
        ours = _fleet_loader(rank, world)
        theirs = DistributedSampler(DATA, num_replicas=world, rank=rank, seed=3)
        for epoch in range(2):
            theirs.set_epoch(epoch)
            assert _ids(ours) == [int(DATA[i][0]) for i in theirs]


def test_a_loader_that_did_not_shuffle_keeps_the_order():
    assert _ids(_fleet_loader(shuffle=False)) == list(range(30))


@pytest.mark.parametrize("taken", [0, 3, 8])  # batches taken of epoch 1 (8 per pass)
def test_resumes_at_the_exact_sample(taken):
    whole = _fleet_loader()
    _ids(whole)  # epoch 0
    expected = _ids(whole)  # epoch 1
    run = _fleet_loader()
    _ids(run)  # epoch 0
    it = iter(run)
    seen = [next(it) for _ in range(taken)]
    state = run.state_dict()
    resumed = _fleet_loader()
    resumed.load_state_dict(state)
    assert _ids(seen) + _ids(resumed) == expected


def test_a_pass_read_to_its_end_resumes_at_the_next_epoch():
    run = _fleet_loader()
    _ids(run)
    state = run.state_dict()
    assert (state["epoch"], state["samples"]) == (1, 0)
    resumed = _fleet_loader()
    resumed.load_state_dict(state)
    reference = _fleet_loader()
    _ids(reference)
    assert _ids(resumed) == _ids(reference)


def test_set_epoch_of_the_epoch_being_read_keeps_the_position():
    run = _fleet_loader()
    it = iter(run)
    next(it)
    resumed = _fleet_loader()
    resumed.load_state_dict(run.state_dict())
    resumed.set_epoch(0)  # a tutorial loop's habit: no restart of the epoch
    assert len(_ids(resumed)) == 30 - 4


def test_a_resumed_pass_does_not_draw_from_torchs_rng():
    """The uninterrupted run drew the loader's base seed before the saved RNG state."""
    run = _fleet_loader()
    it = iter(run)
    next(it)
    resumed = _fleet_loader()
    resumed.load_state_dict(run.state_dict())
    before = torch.get_rng_state()
    iter(resumed).__next__()
    assert torch.equal(torch.get_rng_state(), before)


def test_loaders_it_cannot_shard_are_named():
    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(1)

    with pytest.raises(ConfigError, match="IterableDataset"):
        shard_loader(DataLoader(Stream(), batch_size=2), rank=0, world_size=1, seed=0)
    with pytest.raises(ConfigError, match="batch_sampler"):
        shard_loader(DataLoader(DATA, batch_sampler=[[0, 1]]), rank=0, world_size=1, seed=0)
    unsharded = FleetLoader(DataLoader(DATA), None, on_batch=lambda: None)
    with pytest.raises(ConfigError, match="use_distributed_sampler=False"):
        unsharded.state_dict()
