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
