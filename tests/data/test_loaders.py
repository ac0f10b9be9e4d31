"""The training loader changing world size in place (an in-process recovery)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from gpufleet.config import Config
from gpufleet.data.loaders import build_train_loader


def test_a_loader_resharded_to_one_rank_reads_the_rest_of_the_epoch_once():
    data = TensorDataset(torch.arange(64))
    cfg = Config().data
    cfg = type(cfg)(**{**cfg.__dict__, "batch_size": 4, "num_workers": 0})
    ranks = [build_train_loader(data, cfg, rank=r, world_size=2, seed=3, pin_memory=False)
             for r in range(2)]
    read = []
    for loader in ranks:  # 3 steps at world size 2: 24 samples
        batches = iter(loader.loader)
        read += [int(i) for _ in range(3) for i in next(batches)[0]]
    position = ranks[0].sampler.state_dict(consumed=12)
    survivor = ranks[0]
    assert survivor.batches_in_epoch(0) == 8
    survivor.reshard(0, 1)
    survivor.sampler.load_state_dict(position)
    assert survivor.batches_in_epoch(0) == 16  # a whole epoch, now on one rank
    rest = [int(i) for batch in survivor.loader for i in batch[0]]
    assert len(rest) == 40 and sorted(read + rest) == list(range(64))
