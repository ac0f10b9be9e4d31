"""Which network interface a multi-node run talks over, and which node hosts its store.

Left alone, gloo and NCCL bind to the address the host name resolves to, and torch's
c10d rendezvous decides who hosts the store by comparing the endpoint with the host
name. On machines whose host name resolves to 127.0.0.1 (many containers, pods, cloud
images, network namespaces) both go wrong: the ranks advertise loopback to each other
("connectFullMesh ... Connection refused, remote=[127.0.0.1]") and no node hosts the
store ("The agents did not meet"). Here both are decided by the route instead: the
interface that routes to the master or rendezvous address carries the traffic, and the
node with an interface that owns the endpoint address hosts the store.

Example:
    >>> route_to("127.0.0.1").ifname
    'lo'
    >>> owns_address("127.0.0.1")
    True
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

from gpufleet.errors import LaunchError

if TYPE_CHECKING:
    from gpufleet.launch.rendezvous import LaunchPlan

logger = logging.getLogger(__name__)

# The variables that choose the interface; the user's own setting always wins.
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Route:
    """How this machine reaches an address.

    Attributes:
        target: The address asked about (as given: a name or an IP).
        target_ip: ``target`` resolved.
        local_ip: This machine's source address for it.
        ifname: The interface that owns ``local_ip`` ("" when none was found).
    """

    target: str
    target_ip: str
    local_ip: str
    ifname: str


def resolve_host(host: str) -> str:
    """``host`` as an IP address (the first one the resolver gives).

    Raises:
        LaunchError: the name does not resolve, with the fix.
    """
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except OSError as err:
        raise LaunchError(f"The address {host!r} does not resolve here ({err}). Give node "
                          "0's IP address, or a host name every node can resolve.") from None


def route_to(host: str) -> Route:
    """The local address and interface this machine uses to reach ``host``.

    A UDP socket "connected" to the address sends nothing; the kernel only picks the
    route, whose source address the socket then reports.

    Raises:
        LaunchError: ``host`` does not resolve, or no route leads to it.
    """
    target_ip = resolve_host(host)
    family = socket.AF_INET6 if ":" in target_ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((target_ip, 9))  # port 9 (discard): nothing is sent
            local_ip = sock.getsockname()[0]
    except OSError as err:
        raise LaunchError(f"No network route from this machine to {host} ({target_ip}): "
                          f"{err}. Check the address (--master-addr / --rdzv-endpoint) and "
                          "that this node's network is up.") from None
    return Route(host, target_ip, local_ip, interface_of(local_ip))


def interface_of(ip: str) -> str:
    """Name of the local interface that holds address ``ip`` ("" when none does)."""
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6) and \
                    addr.address.split("%")[0] == ip:
                return name
    return ""


def owns_address(host: str) -> bool:
    """Whether an interface of this machine holds the address ``host`` resolves to."""
    try:
        return bool(interface_of(resolve_host(host)))
    except LaunchError:
        return False


def is_loopback(ip: str) -> bool:
    """Whether ``ip`` is a loopback address (127.0.0.0/8 or ::1).

    Example:
        >>> is_loopback("127.0.1.1"), is_loopback("10.0.0.2")
        (True, False)
    """
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def route_to_peers(host: str, peers: Sequence[str] = ()) -> Route:
    """The route this node's ranks talk over: the one to ``host``, unless that is loopback.

    On the master's own node, a host name mapped to a loopback address (Debian writes
    ``127.0.1.1 <hostname>`` into /etc/hosts) routes to ``lo``, which the other nodes cannot
    reach; the route to the first peer that is not loopback is taken instead.

    Raises:
        LaunchError: ``host`` does not resolve, or no route leads to it.
    """
    route = route_to(host)
    if not is_loopback(route.local_ip):
        return route
    for peer in peers:
        try:
            other = route_to(peer)
        except LaunchError:
            continue
        if not is_loopback(other.local_ip):
            return other
    return route


def choose_socket_ifname(host: str, environ: MutableMapping[str, str] = os.environ,
                         peers: Sequence[str] = ()) -> Route | None:
    """Point gloo and NCCL at the interface that routes to ``host``, unless the user chose.

    Sets each of GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME that is unset (in ``environ``,
    which ranks started later inherit) and logs which interface and why. When ``host``
    routes over loopback here (this node is the master and its name maps to 127.0.1.1),
    the interface that routes to one of ``peers`` (the other nodes) is taken; loopback is
    kept only when every peer is reached over it too (all "nodes" on one machine).

    Returns:
        The route, or None when both variables were already set (nothing changed).
    """
    missing = [name for name in IFNAME_VARIABLES if not environ.get(name)]
    if not missing:
        return None
    route = route_to_peers(host, peers)
    if not route.ifname:
        logger.warning("no interface holds %s (the address that routes to %s); leaving %s "
                       "unset", route.local_ip, host, "/".join(missing))
        return route
    for name in missing:
        environ[name] = route.ifname
    logger.info("multi-node: %s=%s (it routes to %s via %s); set %s yourself to choose "
                "another", "/".join(missing), route.ifname, route.target, route.local_ip,
                " or ".join(missing))
    return route


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` as ``(host, port)``; port 0 when missing.

    Example:
        >>> split_endpoint("10.0.0.1:29500"), split_endpoint("[::1]:7")
        (('10.0.0.1', 29500), ('::1', 7))
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or "]" in port or (":" in host and not host.startswith("[")):
        return endpoint.strip("[]"), 0
    if not port.isdigit():
        raise LaunchError(f"The endpoint {endpoint!r} has no port number. Write HOST:PORT, "
                          "e.g. 10.0.0.1:29500.")
    return host.strip("[]"), int(port)


def node_address(env: Any) -> str:
    """This node's address as the others see it (the source address towards rank 0's
    store) in a multi-node job; "" on one node or when it cannot be told."""
    if env.world_size <= env.local_world_size:
        return ""
    try:
        # On the master's node, a name mapped to loopback: the route to the other nodes.
        return route_to_peers(env.master_addr, getattr(env, "nodes", ())).local_ip
    except LaunchError:
        return ""


def port_holder(port: int) -> str:
    """"; process PID (NAME) listens on it" for a local TCP listener on ``port``, or ""."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                name = psutil.Process(conn.pid).name() if conn.pid else "?"
                return f"; process {conn.pid} ({name}) listens on it"
    except (psutil.Error, OSError):
        pass  # other users' sockets need privileges
    return ""


def check_store_port(port: int, what: str) -> None:
    """Raise a :class:`LaunchError` naming the holder when ``port`` cannot be bound here.

    Binds the way torch's TCPStore does (all interfaces, SO_REUSEADDR), then lets go.
    """
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as e:
            raise LaunchError(
                f"Port {port} is in use on this node ({e.strerror}){port_holder(port)}, and "
                f"this node hosts the {what} there. End that process (a leftover run? "
                "`gpufleet cleanup RUN_DIR`) or pick another port on every node.") from None


def multi_node_network(plan: LaunchPlan) -> tuple[str | None, dict[str, Any]]:
    """This node's address for the others, and the rendezvous settings the route implies.

    The interface that routes to the rendezvous host carries gloo/NCCL traffic; the
    address the agent advertises (rank 0's store, MASTER_ADDR of the ranks) is this
    node's address on that route, not whatever the host name resolves to.
    """
    if plan.mode == "standalone":
        return None, {}
    host, port = split_endpoint(plan.rdzv_endpoint.split(",")[0])
    route = choose_socket_ifname(host) or route_to(host)  # also: a name that does not resolve
    extra: dict[str, Any] = {}
    owner = owns_address(host)
    if plan.mode == "static":
        hosts = plan.rdzv_configs.get("rank") == 0  # node 0 listens at master_addr
        if hosts and not owner:
            raise LaunchError(
                f"This is node 0 (--node-rank 0), which hosts the store at --master-addr "
                f"{host}, but no interface of this machine has that address (its route "
                f"leaves through {route.ifname or '?'} {route.local_ip}). Give node 0's own "
                f"address on every node (here: --master-addr {route.local_ip}), or start "
                "node 0 on the machine that has it.")
        if hosts:
            check_store_port(port, "rendezvous store")
        return route.local_ip, extra
    if plan.rdzv_backend != "c10d":  # etcd: no node hosts a store; the route to a member
        return route.local_ip, extra
    # c10d: torch would compare the endpoint with the host name; the route does not lie.
    hosts = plan.rdzv_configs.get("is_host", owner)
    why = f"{route.ifname} holds {route.target_ip}" if owner else \
        f"no interface holds {route.target_ip}"
    if hosts and "is_host" not in plan.rdzv_configs:
        try:
            check_store_port(port, "rendezvous store")
        except LaunchError:  # e.g. two agents on one machine: the first one hosts it
            hosts, why = False, f"{why}, but its port {port} is taken (another agent here?)"
    extra["is_host"] = hosts
    logger.info("c10d rendezvous at %s: this node %s the store (%s)", plan.rdzv_endpoint,
                "hosts" if hosts else "does not host", why)
    return route.local_ip, extra
