"""GPUs, their driver and how they are connected, as NVML reports them.

NVML (``pynvml`` from the ``nvidia-ml-py`` package) talks to the driver directly, so it
also sees GPUs that a CPU-only torch build, or ``CUDA_VISIBLE_DEVICES``, hides from torch.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from gpufleet.doctor.result import FAIL, OK, WARN, CheckResult

log = logging.getLogger(__name__)

# NVML's common-ancestor levels, named as ``nvidia-smi topo -m`` and NCCL_P2P_LEVEL do.
_TOPO_NAMES = {0: "same board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def check_gpus(torch_cuda_count: int | None) -> list[CheckResult]:
    """Check the GPUs through NVML; ``torch_cuda_count`` is what torch sees (None: no torch).

    Without an NVIDIA driver (a CPU machine) this is a warning, not a failure: training
    runs on the CPU with the gloo backend.
    """
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [CheckResult(
            "gpus", WARN, f"no NVIDIA GPU found: the NVIDIA driver's NVML library is not "
            f"available ({e}). Training will run on the CPU (gloo backend).",
            "nothing to do on a CPU machine; on a GPU machine install the NVIDIA driver "
            "(in a container: run it with --gpus all and the NVIDIA container toolkit)",
            {"count": 0, "nvml_error": str(e)})]
    try:
        return _describe(pynvml, torch_cuda_count)
    finally:
        pynvml.nvmlShutdown()


def _describe(pynvml: Any, torch_cuda_count: int | None) -> list[CheckResult]:
    count = pynvml.nvmlDeviceGetCount()
    driver = _text(pynvml.nvmlSystemGetDriverVersion())
    if count == 0:
        return [CheckResult("gpus", WARN, f"NVIDIA driver {driver} is loaded but reports "
                            "no GPU. Training will run on the CPU.",
                            "check `nvidia-smi`; in a container pass --gpus all",
                            {"count": 0, "driver": driver})]
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    gpus = [_gpu_info(pynvml, i, h) for i, h in enumerate(handles)]
    names = sorted({g["name"] for g in gpus})
    mem = ", ".join(f"{g['memory_total_gib']:.0f} GiB" for g in gpus[:1])
    results = [CheckResult(
        "gpus", OK, f"{count} x {' / '.join(names)} ({mem} each), driver {driver}",
        details={"count": count, "driver": driver, "gpus": gpus})]
    busy = [g for g in gpus if g["other_processes"]]
    if busy:
        listed = "; ".join(f"GPU {g['index']}: pids {g['other_processes']}" for g in busy)
        results.append(CheckResult(
            "gpu processes", WARN, f"other processes already use GPU memory ({listed})",
            "if these are leftovers of an earlier run, end them with "
            "`gpufleet cleanup RUN_DIR`", {"busy": [g["index"] for g in busy]}))
    if count > 1:
        results.append(_topology(pynvml, handles, gpus))
    results.append(_torch_sees(count, torch_cuda_count))
    return results


def _gpu_info(pynvml: Any, index: int, handle: Any) -> dict[str, Any]:
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    info: dict[str, Any] = {
        "index": index, "name": _text(pynvml.nvmlDeviceGetName(handle)),
        "memory_total_gib": mem.total / 2**30, "memory_used_gib": mem.used / 2**30,
        "pci_bus_id": _text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
        "nvlinks": _active_nvlinks(pynvml, handle), "other_processes": []}
    try:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        info["other_processes"] = [p.pid for p in procs if p.pid != os.getpid()]
    except pynvml.NVMLError:
        pass  # not supported on every GPU / inside every container
    return info


def _active_nvlinks(pynvml: Any, handle: Any) -> list[str]:
    """Bus ids of the peers of this GPU's active NVLinks (empty without NVLink)."""
    peers = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            peers.append(_text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
        except pynvml.NVMLError:
            break  # no such link (or no NVLink at all)
    return peers


def _topology(pynvml: Any, handles: list[Any], gpus: list[dict[str, Any]]) -> CheckResult:
    pairs: dict[str, str] = {}
    for i in range(len(handles)):
        for j in range(i + 1, len(handles)):
            if _nvlink_p2p(pynvml, handles[i], handles[j]):
                # Direct links name the peer's bus id; through an NVSwitch they do not.
                links = gpus[i]["nvlinks"].count(gpus[j]["pci_bus_id"])
                pairs[f"{i}-{j}"] = f"NV{links}" if links else "NVLink (NVSwitch)"
                continue
            try:
                level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                pairs[f"{i}-{j}"] = _TOPO_NAMES.get(level, str(level))
            except pynvml.NVMLError:
                pairs[f"{i}-{j}"] = "unknown"
    kinds: dict[str, int] = {}
    for kind in pairs.values():
        kind = "NVLink" if kind.startswith("NV") else kind
        kinds[kind] = kinds.get(kind, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    slow = {k: v for k, v in pairs.items() if v in ("NODE", "SYS")}
    status, fix = OK, ""
    if slow and "NVLink" not in kinds:
        status = WARN
        fix = ("pairs across CPU sockets (SYS/NODE) are the slowest path for all-reduce; "
               "prefer GPUs under one socket for small jobs (CUDA_VISIBLE_DEVICES)")
    return CheckResult("gpu topology", status, f"{len(pairs)} GPU pairs: {summary}", fix,
                       {"pairs": pairs})


def _nvlink_p2p(pynvml: Any, a: Any, b: Any) -> bool:
    try:
        status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except pynvml.NVMLError:
        return False
    return status == pynvml.NVML_P2P_STATUS_OK


def _torch_sees(nvml_count: int, torch_count: int | None) -> CheckResult:
    details = {"nvml": nvml_count, "torch": torch_count,
               "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if torch_count is None:
        return CheckResult("torch sees gpus", FAIL, "torch is not importable",
                           "pip install torch", details)
    if torch_count == 0:
        return CheckResult(
            "torch sees gpus", WARN, f"the driver reports {nvml_count} GPU(s) but torch sees "
            "none, so training would run on the CPU", "install a CUDA build of torch "
            "(see pytorch.org), and check that CUDA_VISIBLE_DEVICES does not hide the GPUs",
            details)
    if torch_count < nvml_count:
        return CheckResult("torch sees gpus", OK, f"torch sees {torch_count} of "
                           f"{nvml_count} GPUs (CUDA_VISIBLE_DEVICES="
                           f"{details['CUDA_VISIBLE_DEVICES']})", details=details)
    return CheckResult("torch sees gpus", OK, f"torch sees all {torch_count} GPUs",
                       details=details)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
