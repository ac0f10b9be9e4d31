import itertools
from collections import Counter

import pytest
from torch.utils.data import DataLoader

from gpufleet.data import ResumableDistributedSampler as Sampler


def ranks(n: int, world: int, **kw) -> list[Sampler]:
    return [Sampler(n, rank=r, world_size=world, **kw) for r in range(world)]


@pytest.mark.parametrize("n, world", [(10, 1), (10, 3), (12, 4), (2, 3), (7, 7)])
def test_ranks_cover_the_dataset_with_padding(n, world):
    samplers = ranks(n, world, seed=1)
    per_rank = [list(s) for s in samplers]
    per = -(-n // world)
    assert all(len(idx) == per == len(s) for idx, s in zip(per_rank, samplers, strict=True))
    counts = Counter(i for idx in per_rank for i in idx)
    assert set(counts) == set(range(n))
    assert sum(counts.values()) == per * world
    assert sum(c - 1 for c in counts.values()) == per * world - n  # only the padding repeats


def test_drop_last_truncates():
    samplers = ranks(10, 3, seed=1, drop_last=True)
    per_rank = [list(s) for s in samplers]
    assert [len(i) for i in per_rank] == [3, 3, 3] == [len(s) for s in samplers]
    flat = [i for idx in per_rank for i in idx]
    assert len(set(flat)) == 9


@pytest.mark.parametrize("n, world", [(10, 3), (12, 4), (2, 3), (1, 1)])
def test_eval_mode_sees_every_index_exactly_once(n, world):
    samplers = ranks(n, world, eval_mode=True)
    per_rank = [list(s) for s in samplers]
    assert [len(i) for i in per_rank] == [len(s) for s in samplers]
    assert sorted(i for idx in per_rank for i in idx) == list(range(n))
    assert per_rank[0] == list(range(0, n, world))
    assert [list(s) for s in samplers] == per_rank  # every pass starts from the beginning


def test_same_order_for_same_seed_and_epoch():
    a, b = Sampler(50, seed=3), Sampler(50, seed=3)
    assert list(a) == list(b)
    assert list(a) == list(b)  # both moved on to epoch 1
    assert list(Sampler(50, seed=4)) != list(Sampler(50, seed=3))


def test_epochs_advance_by_themselves_and_differ():
    s = Sampler(50, seed=0)
    epoch0, epoch1 = list(s), list(s)
    assert s.epoch == 2
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1) == list(range(50))
    s.set_epoch(1)
    assert list(s) == epoch1
    other = Sampler(50, seed=0)
    other.set_epoch(1)
    assert list(other) == epoch1


def test_no_shuffle_keeps_order():
    assert list(Sampler(5, rank=1, world_size=2, shuffle=False)) == [1, 3, 0]


def uninterrupted(n: int, world: int, rank: int, count: int) -> list[int]:
    s = Sampler(n, rank=rank, world_size=world, seed=7)
    return list(itertools.islice(itertools.chain.from_iterable(iter(s) for _ in range(5)),
                                 count))


@pytest.mark.parametrize("k", [0, 1, 3, 4, 5, 9])
def test_resume_matches_the_uninterrupted_run(k):
    n, world, rank = 13, 3, 1  # 5 indices per rank per epoch
    reference = uninterrupted(n, world, rank, 15)
    s = Sampler(n, rank=rank, world_size=world, seed=7)
    seen: list[int] = []
    while len(seen) < k:  # iterate k items, crossing an epoch boundary for k > 5
        it = iter(s)
        seen += itertools.islice(it, k - len(seen))
        if len(seen) < k:
            assert next(it, None) is None
    state = s.state_dict()
    resumed = Sampler(n, rank=rank, world_size=world, seed=7)
    resumed.load_state_dict(state)
    rest = list(itertools.chain(resumed, resumed, resumed))
    assert seen + rest[:15 - k] == reference


def test_exhausted_pass_resumes_at_the_next_epoch():
    s = Sampler(10, seed=2)
    list(s)
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["samples"] == 0
    resumed = Sampler(10, seed=2)
    resumed.load_state_dict(s.state_dict())
    assert list(resumed) == list(s)


def test_consumed_position_survives_prefetch_across_an_epoch_boundary():
    n, world = 20, 2  # 10 per rank per epoch
    reference = uninterrupted(n, world, 0, 30)
    s = Sampler(n, rank=0, world_size=world, seed=7)
    list(s)  # epoch 0 consumed
    it = iter(s)
    consumed = [next(it) for _ in range(6)]  # training took 6 of epoch 1 ...
    list(it)  # ... while a prefetcher already drained it: the sampler is in epoch 2
    assert s.state_dict()["epoch"] == 2
    state = s.state_dict(consumed=6)
    assert (state["epoch"], state["samples"]) == (1, 12)
    resumed = Sampler(n, rank=0, world_size=world, seed=7)
    resumed.load_state_dict(state)
    assert reference[:10] + consumed + list(resumed) + list(resumed) == reference


def test_resume_through_a_dataloader():
    data = list(range(40))
    reference = [b.tolist() for b in DataLoader(data, batch_size=4,
                                                sampler=Sampler(40, rank=1, world_size=2))]
    s = Sampler(40, rank=1, world_size=2)
    batches = iter(DataLoader(data, batch_size=4, sampler=s))
    head = [next(batches).tolist() for _ in range(2)]
    state = s.state_dict(consumed=8)
    resumed = Sampler(40, rank=1, world_size=2)
    resumed.load_state_dict(state)
    tail = [b.tolist() for b in DataLoader(data, batch_size=4, sampler=resumed)]
    assert head + tail == reference


def test_load_rejects_a_different_dataset_or_a_bad_position():
    state = Sampler(10, world_size=2).state_dict()
    with pytest.raises(ValueError, match=r"dataset_len = 10.*dataset_len = 11"):
        Sampler(11, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="samples = 11"):
        Sampler(10, world_size=2).load_state_dict({**state, "samples": 11})


def test_load_rejects_a_damaged_epoch_order():
    """A sampler of the caller's own saves its epoch's order; a damaged one is named."""
    source = [3, 1, 2, 0]
    saved = Sampler(4, shuffle=False, source=source)
    first = next(iter(saved))
    state = saved.state_dict(consumed=1)
    resumed = Sampler(4, shuffle=False, source=[0, 1, 2, 3])
    resumed.load_state_dict(state)
    assert [first, *resumed] == source  # the saved order, not the new source's
    for bad in ([3, 1, 2], [0.5, 1.0, 2.0, 3.0], [[0, 1], [2, 3]], [-1, 0, 1, 2], "0123"):
        with pytest.raises(ValueError, match="epoch_order is not 4 indices"):
            Sampler(4, shuffle=False, source=source).load_state_dict(
                {**state, "epoch_order": bad})


def test_an_older_per_rank_state_still_loads_at_its_own_world_size():
    old = {"epoch": 0, "position": 2, "seed": 7, "world_size": 3, "dataset_len": 13}
    reference = Sampler(13, rank=1, world_size=3, seed=7).rank_indices(0)
    resumed = Sampler(13, rank=1, world_size=3, seed=0)
    resumed.load_state_dict(old)
    assert list(resumed) == reference[2:]
    with pytest.raises(ValueError, match=r"world_size = 3.*world_size = 4"):
        Sampler(13, world_size=4).load_state_dict(old)
    with pytest.raises(ValueError, match="position"):
        Sampler(13, world_size=3).load_state_dict({**old, "position": 6})


@pytest.mark.parametrize("worlds", [(2, 1, 2), (3, 2, 4), (4, 3, 1)])
def test_every_sample_is_read_once_across_world_size_changes(worlds):
    """Each world size consumes a few samples per rank and saves; the next world size
    resumes the global position: the union of what was consumed is the epoch, once."""
    n, read = 60, []
    state = None
    for stint, world in enumerate(worlds):
        samplers = ranks(n, world, seed=3)
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        last = stint == len(worlds) - 1
        per_rank = len(samplers[0].rank_indices(0)) if last else 5
        for s in samplers:
            read += itertools.islice(iter(s), per_rank)
        state = samplers[0].state_dict(consumed=per_rank)
        assert state["samples"] == min(n, sum(1 for _ in read))
    epoch = Counter(read)
    padding = sum(epoch.values()) - n  # only the final world size pads, at the very end
    assert set(epoch) == set(range(n)) and padding < worlds[-1]
    assert sum(c - 1 for c in epoch.values()) == padding


def test_load_takes_the_saved_seed():
    saved = Sampler(30, seed=5)
    resumed = Sampler(30, seed=0)
    resumed.load_state_dict(saved.state_dict())
    assert list(resumed) == list(saved)


def test_state_dict_fields_and_bad_consumed():
    s = Sampler(9, rank=0, world_size=2, seed=4)
    assert s.state_dict() == {"epoch": 0, "samples": 0, "seed": 4, "world_size": 2,
                              "dataset_len": 9}
    with pytest.raises(ValueError, match="consumed"):
        s.state_dict(consumed=6)


@pytest.mark.parametrize("kw, word", [
    ({"rank": 2, "world_size": 2}, "rank = 2"),
    ({"world_size": 0}, "world_size"),
    ({"rank": -1}, "rank"),
])
def test_bad_arguments(kw, word):
    with pytest.raises(ValueError, match=word):
        Sampler(10, **kw)
