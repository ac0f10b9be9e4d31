"""``gpufleet doctor`` inside a SLURM job: which rank of which step this is, whether the
master address and port every rank derives work from this node, and whether this
node's name maps to a loopback address.

Run it the way the training runs (``srun -N2 -n2 gpufleet doctor``): each task reports
for its own node.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from gpufleet.doctor.result import FAIL, OK, WARN, CheckResult
from gpufleet.errors import LaunchError
from gpufleet.launch.env import DistEnv, slurm_step_id
from gpufleet.launch.netif import is_loopback, owns_address, route_to, route_to_peers


def check_slurm(environ: Mapping[str, str]) -> list[CheckResult]:
    """What gpufleet reads from SLURM's variables here, and whether it will work.

    Example:
        >>> check_slurm({})
        []
    """
    job = environ.get("SLURM_JOB_ID", "")
    if not job:
        return []
    step = slurm_step_id(environ)
    try:
        env = DistEnv.detect(environ)
    except LaunchError as e:
        return [CheckResult("slurm", FAIL, str(e), "check the srun options")]
    if env.source != "slurm":
        what = ("a one-task step" if step is not None else
                "the batch script or an salloc shell (no SLURM_STEP_* variables)")
        return [CheckResult("slurm", OK, f"in SLURM job {job}, {what}: not a rank. "
                            "`gpufleet train` here starts its own ranks (--nproc N); "
                            "under `srun` each task is one rank", details={"job": job})]
    host = socket.gethostname()
    results = [CheckResult(
        "slurm", OK, f"rank {env.rank} of {env.world_size} in step {job}.{step}: node "
        f"{env.node_rank} of {len(env.nodes) or '?'} ({host}), local rank {env.local_rank} "
        f"of {env.local_world_size}; master {env.master_addr}:{env.master_port}",
        details={"job": job, "step": step, "rank": env.rank, "world_size": env.world_size,
                 "node_rank": env.node_rank, "nodes": list(env.nodes),
                 "master_addr": env.master_addr, "master_port": env.master_port})]
    results.append(_check_own_name(host, multi_node=env.world_size > env.local_world_size))
    if env.world_size > env.local_world_size:
        results.append(_check_master_route(env))
    return results


def _check_own_name(host: str, multi_node: bool) -> CheckResult:
    try:
        ip = socket.gethostbyname(host)
    except OSError as e:
        return CheckResult("slurm host name", WARN, f"this node's name {host!r} does not "
                           f"resolve ({e})", "add it to /etc/hosts or DNS")
    if is_loopback(ip) and multi_node:
        return CheckResult(
            "slurm host name", WARN, f"this node's name {host!r} maps to {ip} (loopback, as "
            "Debian's /etc/hosts writes it): gloo and NCCL would advertise it to the other "
            "nodes. gpufleet train picks the interface by the route to the other nodes; "
            "other programs need GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME",
            f"map {host} to this node's network address in /etc/hosts",
            {"host": host, "address": ip})
    return CheckResult("slurm host name", OK, f"this node's name {host!r} maps to {ip}",
                       details={"host": host, "address": ip})


def _check_master_route(env: DistEnv) -> CheckResult:
    """The master address resolves, a non-loopback route carries the traffic, and the
    derived port is free on the master's node (the store listens there)."""
    try:
        route = route_to_peers(env.master_addr, env.nodes)
    except LaunchError as e:
        return CheckResult("slurm master", FAIL, str(e), "make every node's name resolve "
                           "on every node, or set MASTER_ADDR to node 0's address")
    details = {"interface": route.ifname, "local_address": route.local_ip,
               "target": route.target}
    if is_loopback(route.local_ip):
        return CheckResult("slurm master", FAIL, f"{env.master_addr} and every other node "
                           f"route over loopback here ({route.local_ip})", "map the node "
                           "names to their network addresses in /etc/hosts", details)
    found = f"ranks talk over {route.ifname} ({route.local_ip}, the route to {route.target})"
    if not _is_master_node(env):
        return CheckResult("slurm master", OK, f"{found}; port {env.master_port} is checked "
                           f"on {env.master_addr}, where the store listens", details=details)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
        try:
            s.bind(("", env.master_port))
        except OSError as e:
            return CheckResult("slurm master", FAIL, f"{found}; port {env.master_port} "
                               f"(from job and step id) is taken here: {e.strerror}",
                               "end the process holding it, or set MASTER_PORT for the step",
                               details)
    return CheckResult("slurm master", OK, f"{found}; port {env.master_port} is free here",
                       details=details)


def _is_master_node(env: DistEnv) -> bool:
    if env.nodes:
        return env.node_rank == 0
    try:
        return owns_address(route_to(env.master_addr).target_ip)
    except LaunchError:
        return False
