"""Fabric-style arguments (``accelerator``, ``devices``, ``precision``, ``strategy``,
``num_nodes``) as gpufleet config overrides.

Every name a Lightning Fabric user writes maps onto one config key; gpufleet's own names
are accepted as they are. The config is then planned once by
:func:`gpufleet.plan.make_plan`, like every other run.

Example:
    >>> fleet_overrides(accelerator="cpu", devices=2, precision="32-true", strategy="ddp")
    {'run.device': 'cpu', 'dist.nproc': 2, 'precision.mode': 'fp32', 'parallel.strategy': 'ddp'}
"""

from __future__ import annotations

from typing import Any

from gpufleet.errors import ConfigError, unknown_choice

ACCELERATORS = {"auto": "auto", "cpu": "cpu", "cuda": "cuda", "gpu": "cuda"}
PRECISIONS = {
    "auto": "auto", "32": "fp32", "32-true": "fp32", "fp32": "fp32",
    "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
    "16": "fp16-mixed", "16-mixed": "fp16-mixed", "fp16-mixed": "fp16-mixed",
}
STRATEGIES = {"auto": "auto", "single": "single", "single_device": "single", "ddp": "ddp",
              "fsdp": "fsdp", "hsdp": "hsdp", "zero1": "zero1", "dp": "dp",
              "local_sgd": "local_sgd"}


def fleet_overrides(accelerator: str | None = "auto", devices: int | str = "auto",
                    precision: str | int | None = "auto", strategy: str | None = "auto",
                    num_nodes: int = 1) -> dict[str, Any]:
    """The config overrides for Fabric-style arguments (see the module doc); an argument
    given as None sets nothing (a config's own value stays).

    Raises:
        ConfigError: a value with no gpufleet meaning, naming the valid ones.
    """
    out: dict[str, Any] = {}
    if accelerator is not None:
        if str(accelerator) not in ACCELERATORS:
            raise ConfigError(unknown_choice("accelerator", str(accelerator), ACCELERATORS))
        out["run.device"] = ACCELERATORS[str(accelerator)]
    if devices != "auto":
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ConfigError(f"devices = {devices!r}: give a number of ranks per node "
                              "(1 or more) or 'auto' (one per visible GPU, 1 on a CPU).")
        out["dist.nproc"] = devices
    if precision is not None:
        if str(precision) not in PRECISIONS:
            raise ConfigError(unknown_choice("precision", str(precision), PRECISIONS))
        out["precision.mode"] = PRECISIONS[str(precision)]
    if strategy is not None:
        if strategy not in STRATEGIES:
            raise ConfigError(unknown_choice("strategy", strategy, STRATEGIES))
        out["parallel.strategy"] = STRATEGIES[strategy]
    if num_nodes != 1:
        out["dist.nnodes"] = str(num_nodes)
    return out
