"""The preflight names what failed, and offers turning itself off only for a device
mismatch."""

from __future__ import annotations

import pytest
import torch

from gpufleet.config import Config
from gpufleet.errors import ConfigError
from gpufleet.train.preflight import is_device_mismatch, preflight


class _Raises(torch.nn.Module):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


def _data() -> list:
    return [(torch.zeros(2), torch.zeros(1)) for _ in range(4)]


def _message(error: Exception) -> str:
    with pytest.raises(ConfigError) as caught:
        preflight(_Raises(error), _data(), torch.nn.functional.mse_loss, Config())
    return str(caught.value)


def test_device_mismatch_gets_the_hint_to_turn_the_preflight_off() -> None:
    text = _message(RuntimeError("Expected all tensors to be on the same device, but "
                                 "found at least two devices, cuda:0 and cpu!"))
    assert "same device" in text
    assert "--run.preflight=false" in text


def test_other_failures_do_not_suggest_turning_the_preflight_off() -> None:
    text = _message(RuntimeError("mat1 and mat2 must have the same dtype"))
    assert "mat1 and mat2 must have the same dtype" in text
    assert "preflight=false" not in text


@pytest.mark.parametrize(("message", "expected"), [
    ("Torch not compiled with CUDA enabled", True),
    ("Found no NVIDIA driver on your system", True),
    ("'tuple' object has no attribute 'size'", False),
])
def test_is_device_mismatch(message: str, expected: bool) -> None:
    assert is_device_mismatch(RuntimeError(message)) is expected


def _numpy_float64() -> list:
    import numpy as np

    return [(np.zeros(2), np.zeros(1, dtype=np.float32)) for _ in range(4)]


def test_a_float64_field_is_named_with_the_cast_to_make() -> None:
    with pytest.raises(ConfigError) as caught:
        preflight(torch.nn.Linear(2, 1), _numpy_float64(), torch.nn.functional.mse_loss,
                  Config())
    text = str(caught.value)
    assert "\n" not in text
    assert "batch[0] (inputs) is a float64 tensor" in text
    assert "float32" in text and "astype" in text


def test_string_labels_are_named_with_the_mapping_to_make() -> None:
    data = [(torch.zeros(2), "cat"), (torch.zeros(2), "dog")]
    with pytest.raises(ConfigError) as caught:
        preflight(torch.nn.Linear(2, 2), data, torch.nn.functional.cross_entropy, Config())
    text = str(caught.value)
    assert "batch[1] (target) holds strings ('cat', ...)" in text
    assert "integer ids" in text


_FACTORIES = '''
import torch
from torch.utils.data import TensorDataset


def model():
    raise ValueError("hidden size 33 is not divisible by 4 heads")


def data():
    x = torch.randn(32, 4)
    return TensorDataset(x, x)
'''


def _train_raising_factory(run_cli, tmp_path, *flags: str):
    (tmp_path / "badjob.py").write_text(_FACTORIES)
    return run_cli("train", "--model", "badjob:model", "--data", "badjob:data",
                   "--model.loss", "torch.nn.functional:mse_loss", "--nproc", "2",
                   "--max-steps", "2", "--run.out_dir=runs", *flags, expect=None)


def test_a_raising_factory_reads_as_one_line_under_the_preflight(run_cli, tmp_path):
    proc = _train_raising_factory(run_cli, tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("gpufleet: error: model.name = 'badjob:model' raised "
                                "ValueError: hidden size 33 is not divisible by 4 heads (")
    assert "badjob.py, line 7)" in lines[-1] and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_start_whose_ranks_fail_leaves_no_run_folder(run_cli, tmp_path):
    proc = _train_raising_factory(run_cli, tmp_path, "--run.preflight=false")
    assert proc.returncode != 0
    assert "model.name = 'badjob:model' raised ValueError" in proc.stderr
    assert list((tmp_path / "runs").iterdir()) == []  # the new run directory is gone


def test_a_training_step_under_pipeline_is_refused_before_anything_is_built() -> None:
    from gpufleet.config import load_config
    from gpufleet.train.preflight import preflight_job

    cfg = load_config(overrides={"parallel.strategy": "pipeline", "model.name": "nowhere:x",
                                 "model.training_step": "nowhere:step"})
    with pytest.raises(ConfigError, match="'pipeline' runs its own schedule"):
        preflight_job(cfg)  # the factories named are never imported


def test_a_dataloader_given_to_fit_is_named_with_its_settings(tmp_path):
    """The first try of a Lightning user (trainer.fit takes loaders): fit says to pass
    the dataset with the loader's batch size, shuffle and collate function."""
    from torch.utils.data import DataLoader, TensorDataset

    import gpufleet

    data = TensorDataset(torch.randn(64, 2), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True, collate_fn=lambda b: b)
    with pytest.raises(ConfigError) as caught:
        gpufleet.fit(torch.nn.Linear(2, 1), loader, loss_fn=torch.nn.functional.mse_loss,
                     overrides={"run.out_dir": str(tmp_path)})
    message = str(caught.value)
    assert "train_data is a DataLoader" in message
    assert "{'data.batch_size': 8, 'data.shuffle': True}" in message
    assert "dataset.collate_fn = loader.collate_fn" in message
    with pytest.raises(ConfigError, match="eval_data is a DataLoader"):
        gpufleet.fit(torch.nn.Linear(2, 1), data, DataLoader(data, batch_size=4),
                     overrides={"run.out_dir": str(tmp_path)})
    assert not list(tmp_path.iterdir())  # refused before anything was made
