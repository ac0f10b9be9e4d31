"""gpufleet: multi-GPU PyTorch training that is fast, survives faults, and says in plain
words why a run is slow.

Example:
    >>> import gpufleet
    >>> cfg = gpufleet.load_config(overrides=["run.max_steps=10"])
    >>> cfg.run.max_steps
    10
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names, imported on first use so that `import gpufleet.config` (or the CLI's
# --help) does not pull in the whole training stack.
_EXPORTS = {
    "fit": "gpufleet.api", "train": "gpufleet.api", "load_checkpoint": "gpufleet.api",
    "Fleet": "gpufleet.fleet", "Fabric": "gpufleet.fleet", "Recovered": "gpufleet.fleet",
    "seed_everything": "gpufleet.fleet.seeding",
    "Config": "gpufleet.config", "load_config": "gpufleet.config",
    "Callback": "gpufleet.core.callbacks",
    "FitResult": "gpufleet.train.engine.result", "Trainer": "gpufleet.train.loop",
    "build_run": "gpufleet.train.engine.build", "Run": "gpufleet.train.engine.run",
    "RunPlan": "gpufleet.plan", "make_plan": "gpufleet.plan", "run_rank": "gpufleet.entry",
    "CheckpointError": "gpufleet.errors", "ConfigError": "gpufleet.errors",
    "GpufleetError": "gpufleet.errors", "LaunchError": "gpufleet.errors",
    "launch": "gpufleet.launch", "DistEnv": "gpufleet.launch",
    "rank_zero_first": "gpufleet.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpufleet' has no attribute {name!r}")
