"""Loaders of streams and loaders that keep their own state, in one process: a loader
left as it is (one process, as Fabric leaves it) that has its own ``state_dict`` /
``load_state_dict`` (as torchdata's StatefulDataLoader) is saved and restored through
them by fleet.save/load. The 2-rank stream (2 workers a rank, stop and resume) is in
tests/examples/test_own_loop.py (the twin launch)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset

import gpufleet


class Stream(IterableDataset):
    def __iter__(self):
        return (torch.tensor([float(i)]) for i in range(12))


class CountingLoader(DataLoader):
    """A loader that keeps its own position: batches handed out, skipped on resume."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.taken = 0

    def __iter__(self):
        batches = super().__iter__()
        for _ in range(self.taken):
            next(batches)
        for batch in batches:
            self.taken += 1
            yield batch

    def state_dict(self) -> dict:
        return {"taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        self.taken = state["taken"]


def test_a_loader_that_keeps_its_own_state_resumes_through_save_and_load(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, run_dir=str(tmp_path / "run"))
    loader = fleet.setup_dataloaders(CountingLoader(Stream(), batch_size=2))
    batches = iter(loader)
    first = [next(batches).view(-1).tolist() for _ in range(2)]
    fleet.save(tmp_path / "ck.pt", {"loader": loader})
    again = fleet.setup_dataloaders(CountingLoader(Stream(), batch_size=2))
    fleet.load(tmp_path / "ck.pt", {"loader": again})
    rest = [b.view(-1).tolist() for b in again]
    assert first + rest == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0],
                            [10.0, 11.0]]
    fleet.finish()
