"""The training loader changing world size in place (an in-process recovery), and the
workers of gpufleet's loaders leaving the garbage they inherit alone."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpufleet.config import Config, load_config
from gpufleet.data.loaders import ForkSafeLoader, build_stream_loader, build_train_loader
from gpufleet.errors import ConfigError


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


class _Inherited:
    """Garbage in a reference cycle whose finalizer notes the process that ran it (a
    loader iterator's or a CUDA tensor's finalizer must not run in a forked worker)."""

    def __init__(self, marks: str) -> None:
        self.marks, self.me = marks, self

    def __del__(self) -> None:
        with open(self.marks, "a") as f:
            f.write(f"{os.getpid()}\n")


class _CollectingData(torch.utils.data.Dataset):
    """Every sample runs a full garbage collection in the worker that reads it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        gc.collect()
        return torch.tensor(i)


@pytest.mark.parametrize("loader_class", [ForkSafeLoader, DataLoader])
def test_forked_workers_never_finalize_the_garbage_they_inherit(tmp_path, loader_class):
    marks = tmp_path / f"{loader_class.__name__}.txt"
    marks.touch()
    gc.disable()  # the garbage is still uncollected when the workers fork
    try:
        _Inherited(str(marks))  # unreachable at once: only the collector frees a cycle
        loader = loader_class(_CollectingData(), batch_size=2, num_workers=2,
                              multiprocessing_context="fork")
        assert sorted(b.tolist() for b in loader) == [[0, 1], [2, 3]]
    finally:
        gc.enable()
    gc.collect()  # in this process the finalizer runs, once
    pids = marks.read_text().split()
    in_workers = [p for p in pids if int(p) != os.getpid()]
    if loader_class is ForkSafeLoader:
        assert pids == [str(os.getpid())] and not in_workers
    else:  # the control: a plain DataLoader's workers do run it
        assert in_workers, pids


def test_a_programs_own_freeze_is_kept_and_its_workers_still_inherit_no_garbage(tmp_path):
    marks = tmp_path / "marks.txt"
    marks.touch()
    gc.freeze()  # the program's own (say, a server that forks after loading)
    frozen = gc.get_freeze_count()
    gc.disable()
    try:
        _Inherited(str(marks))
        loader = ForkSafeLoader(_CollectingData(), batch_size=2, num_workers=2,
                                multiprocessing_context="fork")
        assert len(list(loader)) == 2
        # not thawed (a thaw leaves 0; frozen objects that die leave the count too)
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.enable()
        gc.unfreeze()
    gc.collect()
    assert marks.read_text().split() == [str(os.getpid())]  # collected here, before the fork


def test_a_fit_that_stops_mid_epoch_leaves_no_data_workers(tmp_path):
    """Each fit of one process (a sweep, a notebook) used to leave its loader's
    (persistent) workers, and what they prefetched, alive until the interpreter's exit."""
    import psutil
    import torch.nn.functional as F

    import gpufleet

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    data = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
    for i in range(2):  # 12 steps of the 16 in an epoch: the iterator is not exhausted
        gpufleet.fit(torch.nn.Linear(8, 2), data, loss_fn=F.cross_entropy,
                     overrides={"run.max_steps": 12, "data.batch_size": 32,
                                "data.num_workers": 2,
                                "run.eval_every": 0, "log.progress": "off",
                                "monitor.report": False, "run.dir": str(tmp_path / f"r{i}")})
        left = [p for p in me.children(recursive=True)
                if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
        assert left == [], f"fit {i} left {len(left)} process(es): {left}"


class _Count(torch.utils.data.IterableDataset):
    def __iter__(self):
        return (torch.tensor([float(i)]) for i in range(40))


def test_a_stream_loader_gives_each_rank_full_batches_of_its_chunks():
    """Rank 1 of 2, batches of 4: chunk 1 of each of the 5 rows of 8 that 40 items
    make; token batching is refused on a stream (no lengths up front)."""
    cfg = load_config(overrides={"data.batch_size": 4, "data.num_workers": 0,
                                 "run.max_steps": 10})
    train = build_stream_loader(_Count(), cfg, rank=1, world_size=2, pin_memory=False)
    assert train.stream and train.unit == 4
    assert [b.view(-1).tolist()[0] for b in train.loader] == [4.0, 12.0, 20.0, 28.0, 36.0]
    tokens = load_config(overrides={"data.batching": "tokens", "data.token_budget": 64,
                                    "run.max_steps": 10})
    with pytest.raises(ConfigError, match=r"data\.batching=fixed"):
        build_stream_loader(_Count(), tokens, rank=0, world_size=1, pin_memory=False)
