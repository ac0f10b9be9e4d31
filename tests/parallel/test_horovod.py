"""``horovod`` without Horovod installed: a clear error naming the install step."""

from __future__ import annotations

import pytest
import torch

from gpufleet.config import ParallelConfig
from gpufleet.errors import GpufleetError
from gpufleet.parallel import build_strategy, strategy_names
from gpufleet.parallel.horovod import horovod_available

pytestmark = pytest.mark.skipif(horovod_available(), reason="Horovod is installed here")


def test_horovod_is_registered_but_building_it_names_the_install():
    assert "horovod" in strategy_names()
    with pytest.raises(GpufleetError) as err:
        build_strategy("horovod", ParallelConfig(), torch.device("cpu"))
    message = str(err.value)
    assert "pip install horovod" in message and "horovodrun" in message


def test_the_cli_reports_it_as_a_gpufleet_error(run_cli):
    proc = run_cli("train", "--model", "toyjob:make_model", "--data", "toyjob:make_data",
                   "--model.loss", "torch.nn.functional:mse_loss", "--strategy", "horovod",
                   "--max-steps", "1", expect=2)
    assert "gpufleet: error:" in proc.stderr and "pip install horovod" in proc.stderr
