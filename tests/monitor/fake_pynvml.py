"""A stand-in for the ``pynvml`` module (nvidia-ml-py), for tests on machines without an
NVIDIA driver.

Why a fake: the test machines have no GPU, so the real NVML library cannot load and the
code that reads GPUs would never run. This fake replaces only the ``pynvml`` module
(installed into ``sys.modules`` by the ``fake_nvml`` fixture), with the same function
names, argument order, return shapes and units as nvidia-ml-py: bytes in memory info,
milliwatts for power, ``NVMLError`` raised for a reading the device does not support.
Everything above it (the sampler, ``gpufleet top``, the live view) is the real code. On
a GPU machine the same code paths run against the real library.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
MB = 1024 * 1024


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    util: int = 0
    mem_used_mb: float = 0.0
    mem_total_mb: float = 81559.0
    power_mw: int | None = 300_000  # None: the board does not report power
    temp_c: int = 50
    sm_mhz: int = 1980
    procs: list[tuple[int, int]] = field(default_factory=list)  # (pid, bytes)


def make_module(gpus: list[FakeGpu]) -> types.ModuleType:
    """A module object that answers like pynvml for these GPUs."""
    m = types.ModuleType("pynvml")
    m.NVML_TEMPERATURE_GPU, m.NVML_CLOCK_SM = NVML_TEMPERATURE_GPU, NVML_CLOCK_SM
    m.NVMLError, m.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    m.calls = {"init": 0, "shutdown": 0}

    def init() -> None:
        m.calls["init"] += 1

    def shutdown() -> None:
        m.calls["shutdown"] += 1

    def power(h: FakeGpu) -> int:
        if h.power_mw is None:
            raise NVMLError_NotSupported("Not Supported")
        return h.power_mw

    m.nvmlInit, m.nvmlShutdown = init, shutdown
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    m.nvmlDeviceGetName = lambda h: h.name  # a str in nvidia-ml-py >= 11.515
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=h.util, memory=0)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=int(h.mem_used_mb * MB), total=int(h.mem_total_mb * MB),
        free=int((h.mem_total_mb - h.mem_used_mb) * MB))
    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetTemperature = lambda h, sensor: h.temp_c
    m.nvmlDeviceGetClockInfo = lambda h, clock: h.sm_mhz
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.procs]
    return m


def install(monkeypatch, gpus: list[FakeGpu]) -> types.ModuleType:
    """Put the fake in ``sys.modules["pynvml"]`` for one test; returns it."""
    import sys

    module = make_module(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module
