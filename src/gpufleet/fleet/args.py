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
    # Fabric's true precisions: no autocast, no loss scaling (the run's fp32 recipe);
    # Fleet converts the model and its inputs (gpufleet.fleet.dtypes).
    "bf16-true": "fp32", "16-true": "fp32", "fp16-true": "fp32", "64-true": "fp32",
    "64": "fp32",
}
STRATEGIES = {"auto": "auto", "single": "single", "single_device": "single", "ddp": "ddp",
              "fsdp": "fsdp", "hsdp": "hsdp", "zero1": "zero1", "dp": "dp",
              "local_sgd": "local_sgd",
              # Fabric's ways of starting ddp's ranks: the same DDP and the same numbers;
              # Fleet starts the ranks with torch's elastic agent (see Fleet.launch)
              "ddp_spawn": "ddp", "ddp_fork": "ddp", "ddp_notebook": "ddp"}


#: Fabric's names of fp16 mixed precision, which it makes bf16-mixed on a CPU.
FABRIC_FP16 = ("16-mixed", "16")

#: Fabric's names gpufleet refuses on purpose, and why (the error says it).
_XLA = ("runs on TPUs through torch_xla, and gpufleet has no XLA strategy: its "
        "strategies place the model with torch.distributed (gloo, NCCL). On CPUs and "
        "CUDA GPUs use strategy='ddp' (or 'fsdp'); gpufleet does not run on TPUs.")
REFUSED = {("strategy", "xla"): _XLA, ("strategy", "xla_fsdp"): _XLA,
           ("accelerator", "tpu"): _XLA}


#: What an argument left out means when no config is given: Fabric's defaults (fp32
#: above all: a loop moved from Fabric computes the same numbers).
FABRIC_DEFAULTS = {"accelerator": "auto", "precision": "32-true", "strategy": "auto"}


def fleet_overrides(accelerator: str | None = None, devices: int | str = "auto",
                    precision: str | int | None = None, strategy: str | None = None,
                    num_nodes: int = 1, *, defaults: bool = True,
                    cuda: bool = False) -> dict[str, Any]:
    """The config overrides for Fabric-style arguments (see the module doc). An argument
    left out (None) takes :data:`FABRIC_DEFAULTS`, or with ``defaults=False`` (a config
    was given) sets nothing, so the config's own value stays.

    Fabric's ``"16-mixed"`` (``16``) on a CPU (``accelerator="cpu"``, or ``"auto"``
    without ``cuda`` GPUs) is bf16-mixed, as Fabric decides it (its fp16 autocast is
    CUDA's; :class:`~gpufleet.fleet.Fleet` warns). gpufleet's own ``"fp16-mixed"``
    keeps fp16, as gpufleet's loop does on a CPU.

    Raises:
        ConfigError: a value with no gpufleet meaning, naming the valid ones.
    """
    given = {"accelerator": accelerator, "precision": precision, "strategy": strategy}
    if defaults:
        given = {k: FABRIC_DEFAULTS[k] if v is None else v for k, v in given.items()}
    out: dict[str, Any] = {}
    if given["accelerator"] is not None:
        out["run.device"] = _mapped("accelerator", given["accelerator"], ACCELERATORS)
    if devices != "auto":
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ConfigError(f"devices = {devices!r}: give a number of ranks per node "
                              "(1 or more) or 'auto' (one per visible GPU, 1 on a CPU).")
        out["dist.nproc"] = devices
    if given["precision"] is not None:
        out["precision.mode"] = _mapped("precision", given["precision"], PRECISIONS)
        device = out.get("run.device")
        on_cpu = device == "cpu" or (device == "auto" and not cuda)
        if str(given["precision"]) in FABRIC_FP16 and on_cpu:
            out["precision.mode"] = "bf16-mixed"
    if given["strategy"] is not None:
        out["parallel.strategy"] = _mapped("strategy", given["strategy"], STRATEGIES)
        if out["parallel.strategy"] == "dp" and out.get("run.device") == "cpu":
            out["parallel.strategy"] = "ddp"  # as Fabric: DataParallel is CUDA's only
    if num_nodes != 1:
        out["dist.nnodes"] = str(num_nodes)
    return out


def _mapped(name: str, value: Any, table: dict[str, str]) -> str:
    """The config value ``table`` gives for an argument, or the error naming the valid
    ones (or why gpufleet refuses a name of Fabric's)."""
    why = REFUSED.get((name, str(value)))
    if why is not None:
        raise ConfigError(f"{name}={value!r} {why}")
    if str(value) not in table:
        raise ConfigError(unknown_choice(name, str(value), table))
    return table[str(value)]
