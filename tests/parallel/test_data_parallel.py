"""Which data parallelism parallelize applies (gpufleet.parallel.data_parallel), decided
from the degrees and each preset's traits, without a process group."""

from __future__ import annotations

import pytest

from gpufleet.parallel import strategy_class
from gpufleet.parallel.data_parallel import data_parallel_kind
from gpufleet.parallel.dims import ParallelDims, StrategyTraits


@pytest.mark.parametrize("name, dims, pipelined, kind", [
    ("single", ParallelDims(), False, ""),
    ("ddp", ParallelDims(), False, "replicate"),  # the preset holds at degree 1
    ("ddp", ParallelDims(dp_replicate=4), False, "replicate"),
    ("ddp", ParallelDims(dp_replicate=2, tp=4), False, "shard"),  # DDP cannot hold DTensors
    ("zero1", ParallelDims(dp_replicate=2), False, "replicate"),
    ("local_sgd", ParallelDims(dp_replicate=2), False, "replicate"),
    ("fsdp", ParallelDims(), False, "shard"),
    ("hsdp", ParallelDims(dp_replicate=2, dp_shard=2), False, "shard"),
    ("pipeline", ParallelDims(pp=2), True, ""),
    ("pipeline", ParallelDims(pp=2, tp=2), True, ""),
    ("pipeline", ParallelDims(pp=2, dp_replicate=4), True, "shard"),  # replicas of a stage
    ("horovod", ParallelDims(dp_replicate=4), False, ""),  # its optimizer reduces
    ("dp", ParallelDims(), False, "threads"),
    ("model_parallel", ParallelDims(), False, ""),
])
def test_each_preset_gets_its_data_parallelism_by_degree(name, dims, pipelined, kind):
    assert data_parallel_kind(strategy_class(name).traits, dims, pipelined) == kind


def test_a_degree_above_one_asks_for_data_parallelism_without_a_preset():
    none = StrategyTraits(data_parallel="none")
    assert data_parallel_kind(none, ParallelDims(dp_replicate=2), False) == "replicate"
    assert data_parallel_kind(none, ParallelDims(dp_shard=2), False) == "shard"
    assert data_parallel_kind(none, ParallelDims(tp=2), False) == ""


def test_the_presets_say_what_they_are_by_traits():
    assert [n for n in ("single", "ddp", "fsdp", "pipeline", "zero1")
            if strategy_class(n).traits.several_models] == ["single", "ddp"]
    assert strategy_class("pipeline").traits.pipelined
    assert strategy_class("model_parallel").traits.device_map
    with pytest.raises(ValueError, match="valid: none, replicate, shard"):
        StrategyTraits(data_parallel="ddp")
