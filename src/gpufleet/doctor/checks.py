"""The checks ``gpufleet doctor`` runs; each returns :class:`CheckResult` objects.

Which findings block training (status ``fail``, exit code 1):

* torch cannot be imported;
* no TCP port can be bound, ``MASTER_PORT`` is not a port number, or it is already taken
  on the node that must listen on it (``MASTER_ADDR`` unset or this host);
* ``MASTER_ADDR`` does not resolve;
* ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` match no interface of this host (process
  group init fails);
* a misspelled variable: a name NCCL, Gloo and PyTorch never read, but that is a known
  mistake for a real name or within a character or two of one (``NCCL_IB_DISABLED`` for
  ``NCCL_IB_DISABLE``). Nothing would fail, which is the problem: the run goes on without
  the setting the user believes is in effect (InfiniBand still on, the wrong interface,
  no debug log), and the symptom shows up hours later as a hang or a slow run.

Everything else is a warning (status ``warn``, exit code 0): no GPU (a CPU machine is
fine), a small ``/dev/shm``, few CPU cores, old or removed variable names, values outside
the documented ones, names no table knows that are not close to a known one (a plugin, or
a newer NCCL, may read them).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from gpufleet.doctor import envvars
from gpufleet.doctor.result import FAIL, OK, WARN, CheckResult

log = logging.getLogger(__name__)

MIN_SHM_BYTES = 1 << 30  # below this, DataLoader workers run out of shared memory
RESOLVE_TIMEOUT_S = 5.0


def check_versions() -> list[CheckResult]:
    """Python, torch, CUDA, cuDNN and NCCL versions (CUDA ones only with a CUDA torch)."""
    from gpufleet import __version__

    details = {"gpufleet": __version__, "python": sys.version.split()[0]}
    try:
        import torch
    except ImportError as e:
        return [CheckResult("versions", FAIL, f"torch cannot be imported: {e}",
                            "pip install torch (see pytorch.org for the CUDA build)",
                            details)]
    details["torch"] = torch.__version__
    details["cuda"] = torch.version.cuda
    details["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() \
        else None
    details["nccl"] = None
    if torch.cuda.is_available():
        try:
            nccl = torch.cuda.nccl.version()
            details["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except (RuntimeError, AttributeError) as e:
            log.debug("no NCCL version: %s", e)
    text = ", ".join(f"{k} {v}" for k, v in details.items() if v is not None)
    if details["cuda"] is None:
        text += " (CPU build of torch: no CUDA, no NCCL)"
    return [CheckResult("versions", OK, text, details=details)]


def check_cpus() -> CheckResult:
    """CPU cores: logical, physical, the ones this process may run on, a cgroup quota."""
    import psutil

    logical = os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    quota = _cgroup_cpu_quota()
    usable = min(affinity, int(quota)) if quota else affinity
    details = {"logical": logical, "physical": physical, "affinity": affinity,
               "cgroup_quota": quota, "usable": max(usable, 1)}
    text = f"{logical} logical cores ({physical} physical)"
    if affinity < logical:
        text += f", this process may use {affinity} (CPU affinity)"
    if quota:
        text += f", container quota {quota:g} cores"
    if usable < 2:
        return CheckResult("cpus", WARN, text + "; one core feeds both the training loop "
                           "and any data-loader workers", "give the job more cores "
                           "(container --cpus, taskset, SLURM --cpus-per-task)", details)
    return CheckResult("cpus", OK, text, details=details)


def _cgroup_cpu_quota() -> float | None:
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def check_memory() -> CheckResult:
    """Host memory, total and available."""
    import psutil

    mem = psutil.virtual_memory()
    details = {"total_gib": mem.total / 2**30, "available_gib": mem.available / 2**30}
    text = f"{details['total_gib']:.1f} GiB, {details['available_gib']:.1f} GiB available"
    if mem.available < 2 << 30:
        return CheckResult("memory", WARN, text, "less than 2 GiB free: data-loader workers "
                           "and checkpoints may be killed by the OOM killer", details)
    return CheckResult("memory", OK, text, details=details)


def check_shm(path: str = "/dev/shm") -> CheckResult:
    """Size of the shared-memory file system that DataLoader workers pass batches through."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return CheckResult("shared memory", WARN, f"{path} does not exist; DataLoader "
                           "workers (num_workers > 0) cannot pass tensors to the loop",
                           "mount a tmpfs at /dev/shm, or use data.num_workers = 0")
    return shm_result(path, usage.total, usage.free)


def shm_result(path: str, total: int, free: int) -> CheckResult:
    """Judge a shared-memory file system of ``total`` bytes with ``free`` bytes free.

    Example:
        >>> shm_result("/dev/shm", 64 << 20, 64 << 20).status
        'warn'
    """
    details = {"path": path, "total_gib": total / 2**30, "free_gib": free / 2**30}
    text = f"{path}: {total / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free"
    if total < MIN_SHM_BYTES:
        return CheckResult(
            "shared memory", WARN, text + "; DataLoader workers fail with 'bus error' or "
            "'unable to write to file </torch_...>' on batches that do not fit",
            "docker run --shm-size=16g (or --ipc=host); Kubernetes: an emptyDir volume with "
            "medium: Memory mounted at /dev/shm", details)
    if free < total // 10:
        return CheckResult("shared memory", WARN, text + "; almost full",
                           f"look for leftover files of ended runs in {path}, or for "
                           "leftover processes (gpufleet cleanup RUN_DIR)", details)
    return CheckResult("shared memory", OK, text, details=details)


def check_ports(environ: Mapping[str, str]) -> list[CheckResult]:
    """A free ephemeral TCP port, and ``MASTER_PORT`` free when this host must listen on it."""
    results = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        results.append(CheckResult("free port", OK, f"can bind a free TCP port ({port})"))
    except OSError as e:
        results.append(CheckResult("free port", FAIL, f"cannot bind any TCP port: {e}",
                                   "the rendezvous store needs a TCP port; check the "
                                   "sandbox/container network settings"))
    if "MASTER_PORT" in environ:
        results.append(_check_master_port(environ["MASTER_PORT"], environ.get("MASTER_ADDR")))
    return results


def _check_master_port(text: str, addr: str | None) -> CheckResult:
    try:
        port = int(text)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        return CheckResult("MASTER_PORT", FAIL, f"MASTER_PORT={text!r} is not a port number",
                           "set MASTER_PORT to a number from 1024 to 65535")
    if addr and not _is_this_host(addr):
        return CheckResult("MASTER_PORT", OK, f"port {port} is on {addr}, not this host; "
                           "run `gpufleet doctor` there to check it is free")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
        try:
            s.bind(("", port))
        except OSError as e:
            return CheckResult("MASTER_PORT", FAIL, f"MASTER_PORT={port} is taken on this "
                               f"host ({e.strerror}){_listener(port)}", "end that process "
                               "(a leftover run? `gpufleet cleanup RUN_DIR`) or pick another "
                               "port (--master-port)", {"port": port})
    return CheckResult("MASTER_PORT", OK, f"MASTER_PORT={port} is free", details={"port": port})


def _listener(port: int) -> str:
    from gpufleet.launch.netif import port_holder

    return port_holder(port)


def _is_this_host(addr: str) -> bool:
    import psutil

    if addr in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    ips = _resolve(addr) or []
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    return any(ip.startswith("127.") or ip == "::1" or ip in local for ip in ips)


def _resolve(host: str, timeout: float = RESOLVE_TIMEOUT_S) -> list[str] | None:
    """Addresses of ``host``, or None when it does not resolve within ``timeout``."""
    found: list[list[str]] = []

    def work() -> None:
        try:
            found.append(sorted({i[4][0] for i in socket.getaddrinfo(host, None)}))
        except (OSError, UnicodeError):
            pass

    thread = threading.Thread(target=work, daemon=True)  # getaddrinfo has no timeout
    thread.start()
    thread.join(timeout)
    return found[0] if found else None


def check_master_addr(environ: Mapping[str, str]) -> list[CheckResult]:
    """``MASTER_ADDR`` resolves (when set)."""
    addr = environ.get("MASTER_ADDR")
    if not addr:
        return []
    ips = _resolve(addr)
    if ips is None:
        return [CheckResult("MASTER_ADDR", FAIL, f"MASTER_ADDR={addr!r} does not resolve "
                            f"(within {RESOLVE_TIMEOUT_S:g} s)", "use the IP address of "
                            "node 0, or a name every node can resolve")]
    return [CheckResult("MASTER_ADDR", OK, f"MASTER_ADDR={addr} resolves to {', '.join(ips)}",
                        details={"addresses": ips})]


def check_env(environ: Mapping[str, str]) -> list[CheckResult]:
    """Every NCCL_*, TORCH_NCCL_*, GLOO_*, ... variable, and NCCL's configuration files."""
    import psutil

    interfaces = list(psutil.net_if_addrs())
    names = sorted(n for n in environ if envvars.watched(n))
    results = [_finding(f, "") for f in envvars.check_environment(environ, interfaces)]
    for conf in _nccl_conf_files(environ):
        settings = _read_conf(conf)
        names += [f"{n} ({conf})" for n in settings if envvars.watched(n)]
        results += [_finding(f, f" (in {conf})")
                    for f in envvars.check_environment(settings, interfaces)]
    if not results:
        text = (f"{len(names)} variable(s) set, all known: {', '.join(names)}" if names else
                "no NCCL_*, TORCH_NCCL_*, GLOO_* variables set (library defaults)")
        results.append(CheckResult("environment", OK, text, details={"variables": names}))
    return results


def _finding(f: envvars.Finding, where: str) -> CheckResult:
    return CheckResult(f"env {f.name}{where}", f.severity, f.message, f.fix,
                       {"variable": f.name, "value": f.value, "suggestion": f.suggestion})


def _nccl_conf_files(environ: Mapping[str, str]) -> list[str]:
    """NCCL's configuration files that exist: NCCL_CONF_FILE (or ~/.nccl.conf), /etc/nccl.conf."""
    user = environ.get("NCCL_CONF_FILE") or os.path.expanduser("~/.nccl.conf")
    return [p for p in (user, "/etc/nccl.conf") if os.path.isfile(p)]


def _read_conf(path: str) -> dict[str, str]:
    settings = {}
    try:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, value = line.split("=", 1)
                settings[key.strip()] = value.strip()
    except OSError as e:
        log.warning("cannot read %s: %s", path, e)
    return settings


def run_checks(environ: Mapping[str, str] | None = None, master_addr: str = "",
               rdzv_endpoint: str = "") -> list[CheckResult]:
    """Run every check; a check that crashes is reported as a warning, never raised.

    Example:
        >>> results = run_checks({})
        >>> {r.status for r in results} <= {"ok", "warn", "fail"}
        True
    """
    from gpufleet.doctor.gpus import check_gpus
    from gpufleet.doctor.network import check_hostname, check_route
    from gpufleet.doctor.slurm import check_slurm

    env = os.environ if environ is None else environ
    steps: list[tuple[str, Callable[[], object]]] = [
        ("versions", check_versions), ("gpus", lambda: check_gpus(_torch_cuda_count())),
        ("cpus", check_cpus), ("memory", check_memory), ("shared memory", check_shm),
        ("ports", lambda: check_ports(env)), ("MASTER_ADDR", lambda: check_master_addr(env)),
        ("environment", lambda: check_env(env)), ("host name", check_hostname),
        ("route", lambda: check_route(env, master_addr, rdzv_endpoint)),
        ("slurm", lambda: check_slurm(env))]
    results: list[CheckResult] = []
    for name, step in steps:
        try:
            out = step()
        except Exception as e:  # a broken check must not hide the others
            log.debug("check %s crashed", name, exc_info=True)
            out = CheckResult(name, WARN, f"could not check: {type(e).__name__}: {e}")
        results.extend(out if isinstance(out, list) else [out])
    return results


def _torch_cuda_count() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
