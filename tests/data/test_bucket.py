import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from gpufleet.data.bucket import BucketBatchSampler, pad_collate, padded_waste

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])



def _random_lengths(n: int, seed: int, high: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, high + 1, size=n).tolist()


# Hypothesis itself draws short lists (shrinkable edge cases); large ones come from numpy.
lengths_st = st.one_of(
    st.lists(st.integers(1, 512), min_size=1, max_size=40),
    st.builds(_random_lengths, st.integers(1, 2000), st.integers(0, 2**16),
              st.sampled_from([8, 64, 512])),
)
config_st = st.fixed_dictionaries({
    "token_budget": st.integers(1, 2048),
    "max_samples": st.sampled_from([0, 1, 7, 32]),
    "max_len": st.sampled_from([0, 16, 300]),
    "sort_size": st.sampled_from([1, 3, 100]),
    "world_size": st.integers(1, 4),
    "uneven": st.sampled_from(["repeat", "drop"]),
    "seed": st.integers(0, 2**16),
})


def ranks(lengths, world_size: int, **kw) -> list[BucketBatchSampler]:
    return [BucketBatchSampler(lengths, rank=r, world_size=world_size, **kw)
            for r in range(world_size)]


def limit(cfg: dict) -> int:
    return min(cfg["max_len"], cfg["token_budget"]) if cfg["max_len"] else cfg["token_budget"]


@SETTINGS
@given(lengths=lengths_st, cfg=config_st)
def test_batches_are_even_within_budget_and_cover_the_data(lengths, cfg):
    samplers = ranks(lengths, **cfg)
    announced = [len(s) for s in samplers]
    per_rank = [list(s) for s in samplers]
    steps = len(per_rank[0])
    assert [len(b) for b in per_rank] == announced == [steps] * cfg["world_size"]

    overlong = {i for i, n in enumerate(lengths) if n > limit(cfg)}
    eligible = set(range(len(lengths))) - overlong
    assert all(s.overlong == len(overlong) for s in samplers)
    assert set(samplers[0].overlong_indices) == overlong

    flat = [i for batches in per_rank for b in batches for i in b]
    assert not overlong & set(flat)
    for b in itertools.chain.from_iterable(per_rank):
        assert b, "no empty batches"
        assert max(lengths[i] for i in b) * len(b) <= cfg["token_budget"]
        assert not cfg["max_samples"] or len(b) <= cfg["max_samples"]
    if cfg["uneven"] == "repeat":
        assert set(flat) == eligible
        assert steps >= 1 if eligible else steps == 0
    else:
        assert len(flat) == len(set(flat))  # nothing repeats


@SETTINGS
@given(lengths=lengths_st, cfg=config_st, data=st.data())
def test_resume_after_k_batches_across_an_epoch_boundary(lengths, cfg, data):
    rank = data.draw(st.integers(0, cfg["world_size"] - 1))
    a = BucketBatchSampler(lengths, rank=rank, **cfg)
    epoch0 = list(a)
    epoch1 = a.rank_batches(1)
    k = data.draw(st.integers(0, len(epoch1)))
    it = iter(a)
    head = [next(it) for _ in range(k)]
    state = a.state_dict()
    assert state["epoch"] == 1 and state["position"] == k

    b = BucketBatchSampler(lengths, rank=rank, **cfg)
    b.load_state_dict(state)
    assert head + list(b) == epoch1
    assert list(b) == a.rank_batches(2)  # then it goes on like the uninterrupted run

    # Resuming within epoch 0 from a count given by the training loop.
    j = data.draw(st.integers(0, len(epoch0)))
    c = BucketBatchSampler(lengths, rank=rank, **cfg)
    list(c)  # the sampler ran to the end (prefetch), training consumed only j batches
    d = BucketBatchSampler(lengths, rank=rank, **cfg)
    d.load_state_dict(c.state_dict(consumed_batches=j))
    assert list(d) == epoch0[j:]


def test_deterministic_per_seed_and_epoch_and_different_across_epochs():
    lengths = np.random.default_rng(0).integers(1, 300, size=1000)
    a = BucketBatchSampler(lengths, token_budget=1024, world_size=2, rank=1, seed=5)
    b = BucketBatchSampler(lengths, token_budget=1024, world_size=2, rank=1, seed=5)
    e0, e1 = list(a), list(a)
    assert e0 == list(b) and e1 == list(b)
    assert e0 != e1
    assert a.epoch == 2
    a.set_epoch(1)
    assert list(a) == e1
    other = BucketBatchSampler(lengths, token_budget=1024, world_size=2, rank=1, seed=6)
    assert list(other) != e0


def test_more_ranks_than_batches():
    repeat = ranks([3, 4], 4, token_budget=10)
    assert [list(s) for s in repeat] == [[[0, 1]]] * 4
    drop = ranks([3, 4], 4, token_budget=10, uneven="drop")
    assert [list(s) for s in drop] == [[]] * 4
    assert [len(s) for s in ranks([50], 3, token_budget=10)] == [0, 0, 0]  # all over-long


def test_overlong_samples_are_counted_and_warned(caplog):
    with caplog.at_level("WARNING"):
        s = BucketBatchSampler([5, 40, 10, 100], token_budget=64, max_len=50)
    assert s.overlong == 1 and s.overlong_indices == [3]
    assert "1 of 4 samples" in caplog.text
    assert sorted(i for b in s for i in b) == [0, 1, 2]


def test_bucketing_pads_much_less_than_random_batching():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(100), 1.0, size=20_000), 1, 2048).astype(int)
    s = BucketBatchSampler(lengths, token_budget=8192)
    assert padded_waste(lengths, list(s)) < 0.05
    random_batches = np.array_split(rng.permutation(len(lengths)), len(lengths) // 50)
    assert padded_waste(lengths, random_batches) > 0.4


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match=r"uneven = 'repeats'.*'repeat'"):
        BucketBatchSampler([1, 2], token_budget=4, uneven="repeats")
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0"):
        BucketBatchSampler([1, 0], token_budget=4)
    with pytest.raises(ValueError, match="rank = 2"):
        BucketBatchSampler([1, 2], token_budget=4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="token_budget = 0"):
        BucketBatchSampler([1, 2], token_budget=0)
    state = BucketBatchSampler([1, 2, 3], token_budget=4, world_size=2).state_dict()
    with pytest.raises(ValueError, match="world_size = 2"):
        BucketBatchSampler([1, 2, 3], token_budget=4).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len = 3"):
        BucketBatchSampler([1, 2], token_budget=4, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="consumed_batches = 99"):
        BucketBatchSampler([1, 2], token_budget=4).state_dict(consumed_batches=99)


class Tokens(Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.arange(1, self.lengths[i] + 1), i  # tokens 1..n, label = index


def test_dataloader_with_pad_collate():
    lengths = np.random.default_rng(2).integers(1, 60, size=300).tolist()
    sampler = BucketBatchSampler(lengths, token_budget=256, max_samples=16, seed=3)
    expected = sampler.rank_batches(0)
    loader = DataLoader(Tokens(lengths), batch_sampler=sampler, collate_fn=pad_collate)
    seen = Counter()
    for (tokens, labels), batch in zip(loader, expected, strict=True):
        assert labels.tolist() == batch
        assert tokens.dtype == torch.long
        assert tokens.shape == (len(batch), max(lengths[i] for i in batch))
        assert tokens.numel() <= 256
        for row, i in zip(tokens, batch):
            n = lengths[i]
            assert row[:n].tolist() == list(range(1, n + 1)) and not row[n:].any()
        seen.update(batch)
    assert set(seen) == set(range(300)) and set(seen.values()) == {1}


def test_pad_collate_plain_sequences_and_errors():
    out = pad_collate([[7, 8], torch.tensor([9])], pad_value=-1)
    assert out.tolist() == [[7, 8], [9, -1]]
    with pytest.raises(ValueError, match="sample 1"):
        pad_collate([torch.tensor([1]), torch.tensor([0.5])])
    with pytest.raises(ValueError, match="empty batch"):
        pad_collate([])
