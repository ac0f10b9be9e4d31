"""Every strategy preset on the built-in GPT and its default data (tests/parallel/presets.py
says what each run must show); the composed layouts by degrees are test_layouts_by_degree.py
(two files, so that two test workers share the runs)."""

from __future__ import annotations

import pytest

from gpufleet.parallel import strategy_names

from .presets import CPU, case, needs_horovod, train_and_check

PRESETS = [
    case("single", 1, ["--strategy", "single", *CPU], "single"),
    case("dp", 1, ["--strategy", "dp", "--device", "cuda"], "dp", pytest.mark.gpu),
    case("ddp", 2, ["--strategy", "ddp", *CPU], "ddp"),
    case("fsdp", 2, ["--strategy", "fsdp", *CPU], "fsdp"),
    case("hsdp", 2, ["--strategy", "hsdp", *CPU], "hsdp"),
    case("zero1", 2, ["--strategy", "zero1", *CPU], "zero1"),
    case("pipeline", 2, ["--strategy", "pipeline", *CPU], "pipeline"),
    case("local_sgd", 2, ["--strategy", "local_sgd", "--parallel.local_sgd.warmup_steps", "2",
                           "--parallel.local_sgd.period", "1", *CPU], "local_sgd"),
    case("model_parallel", 1, ["--strategy", "model_parallel",
                                "--parallel.device_map={'blocks.1' = 'cpu'}", *CPU],
          "model_parallel"),
    case("horovod", 2, ["--strategy", "horovod", *CPU], "horovod", needs_horovod),
]


def test_every_registered_preset_is_in_the_family():
    """A strategy registered later must be added above, or this fails."""
    assert set(strategy_names()) <= {case.id for case in PRESETS}


@pytest.mark.parametrize("name, ranks, flags, strategy", PRESETS)
def test_the_default_gpt_trains_under_every_preset(run_cli, tmp_path, name, ranks, flags,
                                                   strategy):
    train_and_check(run_cli, tmp_path, name, ranks, flags, strategy)
