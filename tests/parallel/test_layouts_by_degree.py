"""Composed layouts given by their degrees alone (parallel.strategy stays auto) on the
built-in GPT and its default data: the plan must take the preset the degrees need, and the
run must show what tests/parallel/presets.py says."""

from __future__ import annotations

import pytest

from .presets import CPU, case, train_and_check

LAYOUTS = [
    case("ddp_x_tp", 4, ["--parallel.dp_replicate", "2", "--parallel.tp", "2", *CPU], "ddp"),
    case("ddp_x_pp", 4, ["--parallel.dp_replicate", "2", "--parallel.pp", "2", *CPU],
          "pipeline"),
    case("fsdp_x_tp_x_pp", 8, ["--parallel.dp_shard", "2", "--parallel.tp", "2",
                                "--parallel.pp", "2", *CPU], "pipeline"),
    case("hsdp_x_tp", 8, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2",
                           "--parallel.tp", "2", *CPU], "fsdp", pytest.mark.slow),
]


@pytest.mark.parametrize("name, ranks, flags, strategy", LAYOUTS)
def test_the_default_gpt_trains_under_a_layout_given_by_degrees(run_cli, tmp_path, name, ranks,
                                                               flags, strategy):
    train_and_check(run_cli, tmp_path, name, ranks, flags, strategy)
