"""FleetLoader: a loader sharded like torch's DistributedSampler, whose saved position
resumes at the exact sample (mid-epoch, at a pass's last batch, after a pass)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from gpufleet.errors import ConfigError
from gpufleet.fleet.loader import FleetLoader, shard_loader

DATA = TensorDataset(torch.arange(30).float().unsqueeze(1))


def _fleet_loader(rank: int = 0, world: int = 1, shuffle: bool = True) -> FleetLoader:
    loader, sampler = shard_loader(DataLoader(DATA, batch_size=4, shuffle=shuffle),
                                   rank=rank, world_size=world, seed=3)
    return FleetLoader(loader, sampler, on_batch=lambda: None)


def _ids(batches) -> list[int]:
    return [int(v) for (x,) in batches for v in x.flatten()]


def test_shards_like_torchs_distributed_sampler():
    world = 3
    for rank in range(world):
        ours = _fleet_loader(rank, world)
        theirs = DistributedSampler(DATA, num_replicas=world, rank=rank, seed=3)
        for epoch in range(2):
            theirs.set_epoch(epoch)
            assert _ids(ours) == [int(DATA[i][0]) for i in theirs]


def test_alone_it_shuffles_as_the_loaders_own_random_sampler():
    """A one-process loop keeps the order (and the draws from torch's random state) of
    its DataLoader(shuffle=True), so its losses match the script it came from."""
    torch.manual_seed(7)
    theirs = [_ids(DataLoader(DATA, batch_size=4, shuffle=True)) for _ in range(2)]
    after = torch.get_rng_state()
    torch.manual_seed(7)
    ours = _fleet_loader()
    assert [_ids(ours) for _ in range(2)] == theirs
    assert torch.equal(torch.get_rng_state(), after)
    # On several ranks a loader with a generator of its own shuffles as Fabric's
    # DistributedSampler does: from seed + epoch.
    fixed = torch.Generator().manual_seed(1)
    loader, _ = shard_loader(DataLoader(DATA, batch_size=4, shuffle=True, generator=fixed),
                             rank=1, world_size=2, seed=3)
    assert _ids(loader) == [int(DATA[i][0]) for i in DistributedSampler(
        DATA, num_replicas=2, rank=1, seed=3)]


def _own_sampler_loaders() -> list[DataLoader]:
    """Loaders whose sampler's own draws are the order: a generator of their own, a
    weighted sampler, fewer samples than the data set."""
    weights = torch.linspace(0.1, 1.0, 30)
    return [DataLoader(DATA, batch_size=4, shuffle=True,
                       generator=torch.Generator().manual_seed(1)),
            DataLoader(DATA, batch_size=4, sampler=WeightedRandomSampler(weights, 18)),
            DataLoader(DATA, batch_size=4, sampler=RandomSampler(DATA, num_samples=13))]


def _set_up(loader: DataLoader, rank: int = 0, world: int = 1) -> FleetLoader:
    shard, sampler = shard_loader(loader, rank=rank, world_size=world, seed=3)
    return FleetLoader(shard, sampler, on_batch=lambda: None)


def test_a_sampler_of_its_own_keeps_its_draws_as_with_fabric():
    """Fabric keeps such a loader as it is in one process and shards its sampler's draws
    on several (DistributedSamplerWrapper); the order once became 0..n-1 (a weighted
    sampler read the whole data set in order) or seed + epoch."""
    for index in range(3):
        torch.manual_seed(4)
        plain = _own_sampler_loaders()[index]
        theirs = [_ids(plain) for _ in range(2)]
        torch.manual_seed(4)
        ours = _set_up(_own_sampler_loaders()[index])
        assert [_ids(ours) for _ in range(2)] == theirs, index
    torch.manual_seed(4)
    draws = _ids(_own_sampler_loaders()[1])  # 18 weighted draws, as a pass draws them
    for rank in range(2):
        torch.manual_seed(4)
        assert _ids(_set_up(_own_sampler_loaders()[1], rank, 2)) == draws[rank::2]


@pytest.mark.parametrize("world", [1, 3])
def test_a_distributed_sampler_of_its_own_keeps_its_order_sharded_once(world):
    """A plain PyTorch loop's loader with its own DistributedSampler (set_epoch every
    epoch): its shuffle and seed, each rank its own share (once read 0..n-1 in order)."""
    for rank in range(world):
        theirs = DistributedSampler(DATA, num_replicas=world, rank=rank, seed=5,
                                    drop_last=True)
        ours = _set_up(DataLoader(DATA, batch_size=4, sampler=theirs), rank, world)
        for epoch in range(2):
            theirs.set_epoch(epoch)
            assert _ids(ours) == [int(DATA[i][0]) for i in theirs], (rank, epoch)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_sampler_of_its_own_resumes_at_the_exact_sample(index):
    """The epoch's draws and the loader's own generator are saved with the position."""
    torch.manual_seed(0)
    whole = _set_up(_own_sampler_loaders()[index])
    expected = _ids(whole) + _ids(whole)
    torch.manual_seed(0)
    run = _set_up(_own_sampler_loaders()[index])
    it = iter(run)
    seen = [next(it) for _ in range(2)]
    state, rng = run.state_dict(), torch.get_rng_state()  # what a checkpoint keeps
    torch.manual_seed(123)
    resumed = _set_up(_own_sampler_loaders()[index])
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert _ids(seen) + _ids(resumed) + _ids(resumed) == expected


def test_a_loader_that_did_not_shuffle_keeps_the_order():
    assert _ids(_fleet_loader(shuffle=False)) == list(range(30))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("taken", [0, 3, 8])  # batches taken of epoch 1 (8 per pass)
def test_resumes_at_the_exact_sample(taken, world):
    torch.manual_seed(0)  # alone, each epoch's order is drawn from torch's random state
    whole = _fleet_loader(world=world)
    _ids(whole)  # epoch 0
    expected = _ids(whole)  # epoch 1
    torch.manual_seed(0)
    run = _fleet_loader(world=world)
    _ids(run)  # epoch 0
    it = iter(run)
    seen = [next(it) for _ in range(min(taken, len(run)))]
    state, rng = run.state_dict(), torch.get_rng_state()  # what a checkpoint keeps
    torch.manual_seed(123)
    resumed = _fleet_loader(world=world)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)  # and brings back
    assert _ids(seen) + _ids(resumed) == expected


def test_one_process_resumes_at_another_world_size_in_the_same_order():
    torch.manual_seed(0)
    alone = _fleet_loader()
    it = iter(alone)
    seen = _ids([next(it) for _ in range(2)])  # 8 of epoch 0's 30
    state = alone.state_dict()
    assert (state["epoch"], state["samples"]) == (0, 8) and "epoch_seed" in state
    rest = _ids(it)
    ranks = []
    for rank in range(2):
        resumed = _fleet_loader(rank, 2)
        resumed.load_state_dict(state)
        ranks.append(_ids(resumed))
    assert sorted(seen + ranks[0] + ranks[1]) == sorted(seen + rest)
    assert [v for pair in zip(ranks[0], ranks[1]) for v in pair][:22] == rest


def test_a_pass_read_to_its_end_resumes_at_the_next_epoch():
    run = _fleet_loader()
    _ids(run)
    state = run.state_dict()
    assert (state["epoch"], state["samples"]) == (1, 0)
    resumed = _fleet_loader()
    resumed.load_state_dict(state)
    reference = _fleet_loader()
    _ids(reference)
    torch.manual_seed(5)  # the random state a checkpoint brings back
    expected = _ids(reference)
    torch.manual_seed(5)
    assert _ids(resumed) == expected


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


def _plain_loader() -> DataLoader:
    return DataLoader(DATA, batch_size=4, shuffle=True)


def _two_batches_an_epoch(loader, epochs: int = 3, set_epoch: bool = False) -> list[int]:
    """A loop that limits its epochs to two batches (``break``)."""
    seen = []
    for epoch in range(epochs):
        if set_epoch:
            loader.set_epoch(epoch)
        for i, batch in enumerate(loader):
            seen.append(batch)
            if i == 1:
                break
    return _ids(seen)


def test_a_pass_left_before_its_end_starts_afresh_as_a_dataloader_does():
    """A loop that breaks out of its epoch reads what the same loop over its own
    DataLoader reads: each new pass from the start of a newly drawn order (the left pass
    does not go on), with the same draws from torch's random state."""
    torch.manual_seed(11)
    theirs = _two_batches_an_epoch(_plain_loader())
    after = torch.get_rng_state()
    torch.manual_seed(11)
    run = _fleet_loader()
    assert _two_batches_an_epoch(run) == theirs
    assert torch.equal(torch.get_rng_state(), after)
    assert run.epoch == 3  # each left pass ended its epoch
    # A peek at one batch (its shapes) leaves its pass too: training then reads a whole
    # epoch, as it would from the DataLoader.
    torch.manual_seed(2)
    plain = _plain_loader()
    next(iter(plain))
    theirs = _ids(plain)
    torch.manual_seed(2)
    run = _fleet_loader()
    next(iter(run))
    assert _ids(run) == theirs and len(theirs) == 30


def test_set_epoch_with_a_left_pass_reads_each_epochs_start():
    world, rank = 3, 1
    theirs = DistributedSampler(DATA, num_replicas=world, rank=rank, seed=3)
    expected = []
    for epoch in range(3):
        theirs.set_epoch(epoch)
        expected += [int(DATA[i][0]) for i in list(theirs)[:8]]  # two batches of 4
    assert _two_batches_an_epoch(_fleet_loader(rank, world), set_epoch=True) == expected


def test_a_checkpoint_after_a_left_pass_resumes_at_the_next_epochs_start():
    torch.manual_seed(0)
    whole = _fleet_loader()
    _two_batches_an_epoch(whole, epochs=1)
    expected = _two_batches_an_epoch(whole, epochs=1)  # the epoch after the left one
    torch.manual_seed(0)
    run = _fleet_loader()
    _two_batches_an_epoch(run, epochs=1)
    state, rng = run.state_dict(), torch.get_rng_state()
    assert (state["epoch"], state["samples"]) == (1, 0)
    resumed = _fleet_loader()
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert _two_batches_an_epoch(resumed, epochs=1) == expected


def test_an_older_iterator_dropped_late_does_not_move_the_epoch():
    run = _fleet_loader()
    older = iter(run)
    next(older)
    newer = iter(run)  # the newer pass (the older one is left: epoch 1 begins)
    first = next(newer)
    del older  # closed after the newer pass began: nothing changes
    assert run.epoch == 1
    assert len(_ids([first]) + _ids(newer)) == 30


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
