"""``model_parallel``: modules placed by the device map, inputs and outputs moved between
devices by hooks; on a CPU-only machine every device is the CPU, so these tests check
the placement logic, the hooks and the errors, and that training equals ``single``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import final_params
from gpufleet.config import ParallelConfig
from gpufleet.errors import ConfigError
from gpufleet.parallel import build_strategy
from gpufleet.parallel.model_parallel import (
    _move_inputs,
    _move_output,
    placement,
    resolve_device_map,
)
from gpufleet.parallel.parallelize import distribute


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.decoder = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def _strategy(device_map: dict):
    return build_strategy("model_parallel", ParallelConfig(device_map=device_map),
                          torch.device("cpu"))


def test_device_map_places_modules_and_the_forward_matches_the_plain_model():
    torch.manual_seed(0)
    plain = EncDec()
    mapped = distribute(copy.deepcopy(plain),
                        _strategy({"encoder": "cpu", "decoder.2": "cpu:0"}))
    assert placement(mapped) == {"encoder": "cpu", "decoder": "cpu"}
    assert len(mapped.decoder[2]._forward_pre_hooks) == 1  # moves its inputs
    assert len(mapped._forward_hooks) == 1  # brings the output back
    x = torch.randn(5, 4)
    torch.testing.assert_close(mapped(x), plain(x))


def test_the_hooks_move_tensors_and_leave_the_rest():
    args, kwargs = _move_inputs(torch.device("meta"))(None, (torch.ones(2), 3),
                                                      {"mask": torch.ones(2)})
    assert args[0].device.type == "meta" and args[1] == 3
    assert kwargs["mask"].device.type == "meta"
    out = _move_output(torch.device("meta"))(None, (), {"y": torch.ones(1), "n": 1})
    assert out["y"].is_meta and out["n"] == 1


def test_longer_prefixes_come_last_so_they_override():
    plan = resolve_device_map(EncDec(), {"decoder.2": "cpu", "decoder": "meta"})
    assert list(plan) == ["decoder", "decoder.2"]


@pytest.mark.parametrize("device_map, words", [
    ({}, ["needs parallel.device_map"]),
    ({"decodr": "cpu"}, ["no module 'decodr'", "Did you mean 'decoder'", "encoder"]),
    ({"encoder": "cuda:3"}, ["'cuda:3'", "CUDA device"]),
    ({"encoder": "gpu0"}, ["'gpu0' is not a device"]),
])
def test_bad_device_maps_say_what_to_write(device_map, words):
    if torch.cuda.device_count() > 3 and "cuda:3" in str(device_map):
        pytest.skip("this machine has a cuda:3")
    with pytest.raises(ConfigError) as err:
        resolve_device_map(EncDec(), device_map)
    for word in words:
        assert word in str(err.value)


def test_training_with_a_device_map_equals_single(run_cli, tmp_path):
    toy = ["--model", "toyjob:make_model", "--data", "toyjob:make_data", "--model.loss",
           "torch.nn.functional:mse_loss", "--max-steps", "4", "--run.out_dir", "runs",
           "--monitor.report", "false"]
    run_cli("train", *toy, "--run-dir", "runs/single")
    run_cli("train", *toy, "--run-dir", "runs/mp", "--strategy", "model_parallel",
            "--parallel.device_map={0 = 'cpu', 3 = 'cpu'}")
    single, mp = final_params(tmp_path / "runs/single"), final_params(tmp_path / "runs/mp")
    assert single.keys() == mp.keys()
    for key in single:
        torch.testing.assert_close(mp[key], single[key])
