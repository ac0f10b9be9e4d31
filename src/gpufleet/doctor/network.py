"""``gpufleet doctor``'s multi-node checks: the interface the ranks will talk over, and
which node hosts the c10d rendezvous store."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from gpufleet.doctor.result import FAIL, OK, WARN, CheckResult
from gpufleet.errors import LaunchError
from gpufleet.launch.netif import IFNAME_VARIABLES, owns_address, route_to, split_endpoint


def check_hostname() -> CheckResult:
    """Whether this host's name resolves to an address other nodes can reach."""
    name = socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError as e:
        return CheckResult("host name", WARN, f"the host name {name!r} does not resolve ({e})",
                           "multi-node runs still work: gpufleet picks the interface by "
                           "route; add the name to /etc/hosts for other tools")
    if ip.startswith("127."):
        # Harmless for gpufleet train (it goes by route and address), so not a warning.
        return CheckResult("host name", OK, f"the host name {name!r} resolves to {ip} "
                           "(loopback, as in many containers): gloo/NCCL and torch's c10d "
                           "rendezvous would advertise loopback to other nodes, so gpufleet "
                           "train picks the interface by route and the store host by "
                           "address; other launchers need GLOO_SOCKET_IFNAME/"
                           "NCCL_SOCKET_IFNAME", {"host": name, "address": ip})
    return CheckResult("host name", OK, f"the host name {name!r} resolves to {ip}",
                       details={"host": name, "address": ip})


def check_route(environ: Mapping[str, str], master_addr: str = "",
                rdzv_endpoint: str = "") -> list[CheckResult]:
    """The interface towards the master or rendezvous address, and who hosts the store."""
    host = (split_endpoint(rdzv_endpoint)[0] if rdzv_endpoint else
            master_addr or environ.get("MASTER_ADDR", ""))
    if not host:
        return []
    try:
        route = route_to(host)
    except LaunchError as e:
        return [CheckResult("route", FAIL, str(e), "give node 0's address as every node "
                            "reaches it (--master-addr / --rdzv-endpoint HOST:PORT)")]
    chosen = {name: environ[name] for name in IFNAME_VARIABLES if environ.get(name)}
    found = (f"traffic to {host} ({route.target_ip}) leaves through "
             f"{route.ifname or '?'} ({route.local_ip})")
    details = {"host": host, "address": route.target_ip, "interface": route.ifname,
               "local_address": route.local_ip, "set": chosen}
    if chosen and any(v.split(",")[0].lstrip("^=") != route.ifname for v in chosen.values()):
        results = [CheckResult("route", WARN, f"{found}, but you set " + ", ".join(
            f"{k}={v}" for k, v in chosen.items()), "unset them to let gpufleet use the "
            "routing interface, unless that interface is the one you mean", details)]
    else:
        unset = [n for n in IFNAME_VARIABLES if n not in chosen]
        how = (f"gpufleet train sets {'/'.join(unset)}={route.ifname} (none set)" if unset
               else "your setting matches")
        results = [CheckResult("route", OK, f"{found}; {how}", details=details)]
    owner = owns_address(route.target_ip)
    where = rdzv_endpoint or f"{host} (MASTER_ADDR)"
    role = ("hosts the store" if owner else
            "connects to the store on the node that owns it; start that node's command too")
    results.append(CheckResult(
        "store host", OK, f"this node {'owns' if owner else 'does not own'} "
        f"{route.target_ip}: with a c10d rendezvous at {where} it {role}",
        details={"hosts_store": owner}))
    return results
