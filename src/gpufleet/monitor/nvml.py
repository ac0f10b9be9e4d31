"""The GPUs through NVML (``nvidia-ml-py``): what the system sampler and ``gpufleet top``
read from each GPU. Nothing is read without a driver (:meth:`Nvml.open` gives None)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

MB = 1024 * 1024


class Nvml:
    """The GPUs NVML sees, or nothing when there is no driver (:meth:`open` gives None).

    Example:
        >>> gpus = Nvml.open()
        >>> gpus is None or isinstance(gpus.sample(), list)
        True
    """

    def __init__(self, pynvml: Any, indices: Sequence[int] | None = None) -> None:
        self.nv = pynvml
        count = pynvml.nvmlDeviceGetCount()
        wanted = range(count) if indices is None else [i for i in indices if 0 <= i < count]
        self.handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in wanted}
        self.names = {i: _text(pynvml.nvmlDeviceGetName(h)) for i, h in self.handles.items()}

    @classmethod
    def open(cls, indices: Sequence[int] | None = None) -> Nvml | None:
        """Initialise NVML; None (said once at debug level) without a driver or a GPU."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded
            log.debug("No GPU readings: NVML is not usable here (%s: %s); sampling the "
                      "host only.", type(e).__name__, e)
            return None
        nvml = cls(pynvml, indices)
        if not nvml.handles:
            log.debug("NVML sees no GPU; sampling the host only.")
            return None
        return nvml

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception as e:
            log.debug("nvmlShutdown: %s", e)

    def sample(self) -> list[dict[str, Any]]:
        """One reading per GPU; a field the GPU does not report is None."""
        nv = self.nv
        out = []
        for i, h in self.handles.items():
            util = self._read(nv.nvmlDeviceGetUtilizationRates, h)
            mem = self._read(nv.nvmlDeviceGetMemoryInfo, h)
            power = self._read(nv.nvmlDeviceGetPowerUsage, h)  # milliwatts
            out.append({
                "index": i, "name": self.names[i],
                "util_pct": util.gpu if util is not None else None,
                "mem_used_mb": round(mem.used / MB, 1) if mem is not None else None,
                "mem_total_mb": round(mem.total / MB, 1) if mem is not None else None,
                "power_w": round(power / 1000, 1) if power is not None else None,
                "temp_c": self._read(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                "sm_clock_mhz": self._read(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
            })
        return out

    def processes(self, index: int) -> list[dict[str, Any]]:
        """The compute processes on GPU ``index``: pid and GPU memory (MB, None if hidden)."""
        found = self._read(self.nv.nvmlDeviceGetComputeRunningProcesses, self.handles[index])
        return [{"pid": p.pid,
                 "gpu_mem_mb": round(p.usedGpuMemory / MB, 1)
                 if isinstance(p.usedGpuMemory, int) else None}
                for p in found or []]

    def _read(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self.nv.NVMLError:  # NotSupported, NoPermission, GpuIsLost, ...
            return None


def visible_indices() -> list[int] | None:
    """The indices in CUDA_VISIBLE_DEVICES, or None (all) when unset or given as UUIDs."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        return None  # GPU-xxxx UUIDs or MIG names: read every GPU


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
