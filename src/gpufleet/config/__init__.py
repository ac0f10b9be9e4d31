"""Configuration: dataclasses per section, TOML + overrides.

A config is checked against a machine and a world size by :func:`gpufleet.resolve.resolve`
(which needs the strategies; this package imports no other part of gpufleet but the
bottom layer and its errors)."""

from __future__ import annotations

from gpufleet.config.loader import (
    config_from_dict,
    config_to_dict,
    help_rows,
    load_config,
    parse_override,
    write_config,
)
from gpufleet.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DistConfig,
    EarlyStopConfig,
    EvalConfig,
    FaultConfig,
    LogConfig,
    ModelConfig,
    MonitorConfig,
    OptimConfig,
    ParallelConfig,
    PerfConfig,
    PrecisionConfig,
    ProfileConfig,
    RunConfig,
    SchedConfig,
)

__all__ = [
    "CheckpointConfig", "Config", "DataConfig", "DistConfig", "EvalConfig", "FaultConfig",
    "LogConfig", "ModelConfig", "MonitorConfig", "OptimConfig", "ParallelConfig", "SchedConfig",
    "EarlyStopConfig",
    "PerfConfig", "PrecisionConfig", "ProfileConfig", "RunConfig",
    "config_from_dict", "config_to_dict", "help_rows", "load_config", "parse_override",
    "write_config",
]
