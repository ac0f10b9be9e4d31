import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from gpufleet.core import machine as machine_module
from gpufleet.data import TokenWindowDataset, default_num_workers, seed_worker, split_train_eval


@pytest.fixture
def token_file(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=1000, dtype=np.uint8)
    path = tmp_path / "tokens.bin"
    data.tofile(path)
    return path, data


def test_windows_match_the_file(token_file):
    path, data = token_file
    ds = TokenWindowDataset(path, block_size=32)
    assert ds.n_tokens == 1000
    assert len(ds) == (1000 - 1) // 32
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64
        assert x.shape == y.shape == (32,)
        assert x.tolist() == data[i * 32:i * 32 + 32].tolist()
        assert torch.equal(y[:-1], x[1:])  # y is x shifted by one
        assert y[-1].item() == data[i * 32 + 32]


def test_every_token_is_predicted_once(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(101, dtype=np.uint8).tofile(path)  # exactly 10 windows of 10 + 1
    ds = TokenWindowDataset(path, block_size=10)
    assert len(ds) == 10
    assert torch.cat([ds[i][1] for i in range(10)]).tolist() == list(range(1, 101))


def test_token_range(token_file):
    path, data = token_file
    ds = TokenWindowDataset(path, block_size=16, start=100, end=200)
    assert ds.n_tokens == 100
    assert len(ds) == 6
    assert ds[0][0].tolist() == data[100:116].tolist()
    assert ds[5][1].tolist() == data[181:197].tolist()


def test_index_errors_and_negative_indices(token_file):
    ds = TokenWindowDataset(token_file[0], block_size=32)
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])
    for bad in (len(ds), -len(ds) - 1):
        with pytest.raises(IndexError):
            ds[bad]


def test_other_dtypes(tmp_path):
    path = tmp_path / "t16.bin"
    np.arange(50_000, 50_100, dtype=np.uint16).tofile(path)
    ds = TokenWindowDataset(path, block_size=8, dtype=np.uint16)
    assert ds.n_tokens == 100
    assert ds[0][0].tolist() == list(range(50_000, 50_008))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="multiple of 2"):
        TokenWindowDataset(tmp_path / "odd.bin", block_size=1, dtype=np.uint16)


def test_bad_range_and_block_size(token_file):
    with pytest.raises(ValueError, match="1000 tokens"):
        TokenWindowDataset(token_file[0], block_size=8, start=10, end=2000)
    with pytest.raises(ValueError, match="block_size"):
        TokenWindowDataset(token_file[0], block_size=0)


def test_pickle_drops_the_memory_map(token_file):
    ds = TokenWindowDataset(token_file[0], block_size=32)
    first = ds[3]
    assert ds._tokens is not None
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._tokens is None
    assert all(torch.equal(a, b) for a, b in zip(clone[3], first, strict=True))


def test_workers_return_the_same_items(token_file):
    ds = TokenWindowDataset(token_file[0], block_size=32)
    ds[0]  # the parent has its map open; workers must not inherit it through pickling
    in_process = list(DataLoader(ds, batch_size=4, num_workers=0))
    workers = list(DataLoader(ds, batch_size=4, num_workers=2,
                              multiprocessing_context="spawn"))
    assert len(workers) == len(in_process)
    for (x0, y0), (x1, y1) in zip(in_process, workers, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_split_train_eval(token_file):
    path, data = token_file
    train, val = split_train_eval(path, block_size=16, eval_fraction=0.1)
    assert (train.start, train.end, val.start, val.end) == (0, 900, 900, 1000)
    assert val[0][0].tolist() == data[900:916].tolist()
    train, val = split_train_eval(path, block_size=16, eval_fraction=0.0)
    assert val is None and train.n_tokens == 1000


def test_split_errors_name_the_sizes(token_file):
    path = token_file[0]
    with pytest.raises(ValueError, match=r"evaluation split has 10 of 1000 tokens.*129"):
        split_train_eval(path, block_size=128, eval_fraction=0.01)
    with pytest.raises(ValueError, match=r"training split has 1000 of 1000 tokens.*2001"):
        split_train_eval(path, block_size=2000, eval_fraction=0.0)
    with pytest.raises(ValueError, match="eval_fraction"):
        split_train_eval(path, block_size=16, eval_fraction=1.0)


class NumpyRandom(torch.utils.data.Dataset):
    """Draws from NumPy's global RNG, as random augmentations do."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return int(np.random.randint(0, 2**31))


def draws(worker_init_fn) -> list[int]:
    loader = DataLoader(NumpyRandom(), batch_size=1, num_workers=2,
                        worker_init_fn=worker_init_fn,
                        generator=torch.Generator().manual_seed(0))
    return [b.item() for b in loader]


def test_seed_worker_seeds_numpy_and_random_from_torch():
    torch.manual_seed(1234)
    seed_worker(0)
    got = (np.random.rand(), random.random())
    np.random.seed(1234)
    random.seed(1234)
    assert got == (np.random.rand(), random.random())


def test_seed_worker_gives_each_worker_its_own_reproducible_numpy_stream():
    seeded = draws(seed_worker)
    # Batches alternate between the two workers: 0, 2, 4, 6 from one, 1, 3, 5, 7 from the other.
    assert seeded[0::2] != seeded[1::2]
    assert draws(seed_worker) == seeded


def test_default_num_workers(monkeypatch):
    monkeypatch.setattr(machine_module.os, "cpu_count", lambda: 16)
    assert default_num_workers("cpu", 1) == 0
    assert default_num_workers("cuda", 1) == 4
    assert default_num_workers("cuda", 4) == 3
    assert default_num_workers("cuda", 16) == 1
    monkeypatch.setattr(machine_module.os, "cpu_count", lambda: None)
    assert default_num_workers("cuda", 2) == 1
    with pytest.raises(ValueError, match="local_world_size"):
        default_num_workers("cuda", 0)
