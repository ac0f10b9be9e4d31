"""Hugging Face ``datasets`` as training data: a Dataset read from disk (memory-mapped
Arrow) trains with dict rows, resumes exactly, and a DatasetDict gives train + eval."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import gpufleet
from gpufleet.core.callbacks import Callback
from gpufleet.data.hf import hf_train_eval
from gpufleet.errors import ConfigError

datasets = pytest.importorskip("datasets")

SETTINGS = {"run.max_steps": 12, "log.progress": "off", "log.every": 1,
            "data.batch_size": 8, "data.shuffle": True, "data.num_workers": 0,
            "monitor.report": False, "run.eval_every": 0, "optim.lr": 0.05}


def _rows(n: int, offset: int = 0) -> dict:
    g = torch.Generator().manual_seed(offset)
    ids = torch.randint(0, 50, (n, 6), generator=g)
    return {"idx": list(range(offset, offset + n)), "input_ids": ids.tolist(),
            "labels": (ids.sum(1) % 2).tolist()}


@pytest.fixture
def on_disk(tmp_path):
    """A Dataset saved to disk and loaded back: Arrow files, memory-mapped."""
    path = tmp_path / "ds"
    datasets.Dataset.from_dict(_rows(96)).save_to_disk(str(path))
    return datasets.load_from_disk(str(path))


class Classifier(nn.Module):
    """Takes the dict rows as keyword arguments; remembers the rows it trained on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(50, 8)
        self.head = nn.Linear(8, 2)
        self.seen: list[int] = []

    def forward(self, input_ids, labels, idx):
        if self.training:
            self.seen += idx.tolist()
        return nn.functional.cross_entropy(self.head(self.emb(input_ids)), labels)


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, view, step):
        if step == self.step:
            raise KeyboardInterrupt


def _fit(data, run_dir, eval_data=None, callbacks=(), **extra):
    model = Classifier()
    result = gpufleet.fit(model, data, eval_data, callbacks=callbacks,
                          overrides={**SETTINGS, "run.dir": str(run_dir), **extra})
    return model, result


def test_a_dataset_from_disk_trains_on_dict_rows_in_loader_workers(on_disk, tmp_path):
    assert on_disk.cache_files  # backed by Arrow files, not memory
    model, result = _fit(on_disk, tmp_path / "run", **{"data.num_workers": 2})
    assert result.steps == 12
    # 12 steps x 8 rows, every row of the epoch once (96 rows), in shuffled order.
    assert sorted(model.seen) == list(range(96)) and model.seen != list(range(96))
    # What a spawned rank or worker receives: the table re-opened from its files.
    assert len(pickle.dumps(on_disk)) < 10_000


def test_set_format_torch_is_kept_and_collated(on_disk):
    formatted = on_disk.with_format("torch", columns=["input_ids", "labels", "idx"])
    train, _ = hf_train_eval(formatted, None)
    assert train is formatted
    assert train[0]["input_ids"].dtype == torch.long
    plain, _ = hf_train_eval(on_disk, None)  # no format: rows become tensors
    assert plain[0]["input_ids"].shape == (6,)


def test_resume_sees_exactly_the_rows_of_an_uninterrupted_run(on_disk, tmp_path):
    whole, _ = _fit(on_disk, tmp_path / "whole")
    cut_dir = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        _fit(on_disk, cut_dir, callbacks=[_StopAt(6)], **{"checkpoint.every": 4})
    resumed, _ = _fit(on_disk, cut_dir, **{"checkpoint.resume": "latest",
                                           "checkpoint.every": 4})
    # Rows of steps 1-4 (in the checkpoint) + the rows after the resume = the whole run.
    assert len(resumed.seen) == 8 * 8
    assert whole.seen[:32] + resumed.seen == whole.seen
    for (name, p), q in zip(whole.state_dict().items(), resumed.state_dict().values(),
                            strict=True):
        assert torch.equal(p, q), name


def test_a_dataset_dict_gives_train_and_validation(on_disk, tmp_path):
    splits = datasets.DatasetDict({"train": on_disk,
                                   "validation": datasets.Dataset.from_dict(_rows(16, 1000))})
    model, result = _fit(splits, tmp_path / "run", **{"run.eval_every": 6})
    assert sorted(model.seen) == list(range(96))  # validation rows never trained on
    assert [step for step, _ in result.eval_losses] == [6, 12]
    with pytest.raises(ConfigError, match="no 'train'"):
        hf_train_eval(datasets.DatasetDict({"training": on_disk}), None)
    with pytest.raises(ConfigError, match="eval_data is also given"):
        hf_train_eval(splits, on_disk)
