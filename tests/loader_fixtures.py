"""Data sets for the DataLoader benchmark tests: importable by DataLoader workers and by
`python -m gpufleet bench loader` (tests/ is put on PYTHONPATH by `run_cli`)."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


class SlowDataset(Dataset):
    """``n`` samples of shape ``[dim]``; each ``__getitem__`` sleeps ``delay_s`` first,
    like a data set that waits on a disk or decodes a file (sleeping frees the core, so
    workers help even on a small machine)."""

    def __init__(self, n: int = 512, dim: int = 8, delay_s: float = 0.001) -> None:
        self.n, self.dim, self.delay_s = n, dim, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return torch.full((self.dim,), float(i)), torch.tensor(i)


def make_slow_data(n: int = 512, delay_ms: float = 1.0) -> SlowDataset:
    return SlowDataset(n=n, delay_s=delay_ms / 1000)
