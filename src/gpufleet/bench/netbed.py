"""A cluster on one machine: nodes as Linux network namespaces joined by a bridge.

Each node of a :class:`NetBed` is a network namespace with one interface (``eth0``) and
its own address on a private /24; the bridge that joins them lives in a namespace of its
own, so nothing on the host's network changes (no interface, route or address is added
there). The nodes share the file system, as cluster nodes with a shared run directory
do. Per-node controls: cut and restore the link (the bridge port goes down, as when a
switch port or cable fails: packets vanish, TCP peers see silence), limit its rate with
``tc tbf`` (both directions), and kill every process the bed started on a node.

Tests and benchmarks use it as a context manager; ``scripts/cluster.py`` keeps one up
for a person (``up`` / ``run`` / ``down``). Creating namespaces needs root (or
CAP_NET_ADMIN and CAP_SYS_ADMIN); :func:`netbed_available` says why not otherwise.

Example:
    >>> with NetBed(2) as bed:  # doctest: +SKIP
    ...     server = bed.popen(0, ["python", "-m", "http.server", "8000"])
    ...     bed.link_down(1)          # node 1 stops answering
    ...     bed.rate_limit(1, 20.0)   # or: node 1's link runs at 20 Mbit/s
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

logger = logging.getLogger(__name__)

_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21


class NetBedError(RuntimeError):
    """A namespace, link or qdisc operation of the bed failed (the message names it)."""


def netbed_available() -> str | None:
    """Why a :class:`NetBed` cannot be built here, or None when it can.

    Checks the ``ip`` and ``tc`` tools, the capabilities to make namespaces, and then
    really makes (and removes) one, since containers may refuse even root.

    Example:
        >>> reason = netbed_available()
        >>> reason is None or isinstance(reason, str)
        True
    """
    return _probe()


@lru_cache(maxsize=1)
def _probe() -> str | None:
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return (f"the network bed needs the `{tool}` tool (package iproute2): "
                    "apt-get install iproute2")
    caps = _effective_caps()
    if not (caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1):
        return ("the network bed makes network namespaces, which needs root (CAP_NET_ADMIN "
                "and CAP_SYS_ADMIN); run the tests as root, e.g. in CI")
    name = f"gfprobe{os.getpid()}{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is refused here ({made.stderr.strip()}); run on a host or " \
               "a privileged container"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


class NetBed:
    """N nodes as network namespaces on a private bridge, with link and process controls.

    Args:
        nodes: Number of nodes (1 to 200).
        name_prefix: Prefix of every namespace this bed makes; default a unique one from
            the pid and random bits, so concurrent beds never collide.
        subnet: First three octets of the nodes' /24 (default: a random 10.x.y).

    Everything is torn down by :meth:`close`, on leaving the ``with`` block (also on an
    exception) and at interpreter exit.
    """

    def __init__(self, nodes: int, *, name_prefix: str | None = None,
                 subnet: str | None = None) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"NetBed(nodes={nodes}): give 1 to 200 nodes.")
        reason = netbed_available()
        if reason:
            raise NetBedError(f"cannot build the network bed: {reason}")
        self.nodes = nodes
        self.prefix = name_prefix or f"gf{os.getpid()}x{secrets.token_hex(2)}"
        self.subnet = subnet or f"10.{secrets.randbelow(150) + 100}.{secrets.randbelow(256)}"
        self._procs: dict[int, list[subprocess.Popen]] = {i: [] for i in range(nodes)}
        self._closed = False
        atexit.register(self.close)  # also when the test or script dies on an exception
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ names
    @property
    def bridge_ns(self) -> str:
        """Name of the namespace that holds the bridge."""
        return f"{self.prefix}-br"

    def ns(self, i: int) -> str:
        """Name of node ``i``'s network namespace."""
        self._check(i)
        return f"{self.prefix}-n{i}"

    def namespaces(self) -> list[str]:
        """Every namespace of this bed, nodes first."""
        return [f"{self.prefix}-n{i}" for i in range(self.nodes)] + [self.bridge_ns]

    def addr(self, i: int) -> str:
        """Node ``i``'s IPv4 address on the bridge."""
        self._check(i)
        return f"{self.subnet}.{i + 11}"

    # ------------------------------------------------------------------ build
    def _build(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns = self.ns(i)
            _ip("netns", "add", ns)
            # Both ends are made inside namespaces: the host's interface list never changes.
            _ip("-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", br, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        logger.info("network bed %s: %d node(s) on %s.0/24", self.prefix, self.nodes,
                    self.subnet)

    # -------------------------------------------------------------- processes
    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside node ``i``'s namespace (``ip netns exec``).

        The process gets a session of its own, so :meth:`kill_node` reaches its children.
        Other keyword arguments go to :class:`subprocess.Popen`.
        """
        self._check(i)
        if self._closed:
            raise NetBedError(f"network bed {self.prefix} is closed; make a new one.")
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv],
                                env=dict(env) if env is not None else None,
                                start_new_session=True, **kw)
        self._procs[i].append(proc)
        return proc

    def kill_node(self, i: int) -> list[int]:
        """SIGKILL every process the bed started on node ``i`` and all their children
        (every process in the node's namespace); returns the pids killed."""
        self._check(i)
        killed = _kill_namespace(self.ns(i))
        for proc in self._procs[i]:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self._procs[i]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("pid %d on node %d did not die within 10 s", proc.pid, i)
        self._procs[i] = []
        return killed

    # ------------------------------------------------------------------ links
    def link_down(self, i: int) -> None:
        """Cut node ``i`` off: its bridge port goes down, its packets are dropped silently."""
        _ip("-n", self.bridge_ns, "link", "set", f"v{self._port(i)}", "down")

    def link_up(self, i: int) -> None:
        """Restore node ``i``'s link."""
        _ip("-n", self.bridge_ns, "link", "set", f"v{self._port(i)}", "up")

    def rate_limit(self, i: int, mbit: float | None) -> None:
        """Limit node ``i``'s link to ``mbit`` Mbit/s each way (``tc tbf``); None clears it."""
        port = self._port(i)
        ends = ((self.ns(i), "eth0"), (self.bridge_ns, f"v{port}"))
        if mbit is None:  # no limit set is fine: the default qdisc stays
            for ns, dev in ends:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                               capture_output=True)
            return
        if not mbit > 0:
            raise ValueError(f"rate_limit({i}, {mbit}): give a positive Mbit/s, or None.")
        # Burst: ~10 ms of traffic, at least a few full frames; latency bounds the queue.
        burst = max(16_000, int(mbit * 1e6 / 8 / 100))
        for ns, dev in ends:
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                  f"{mbit}mbit", "burst", str(burst), "latency", "200ms"])

    # --------------------------------------------------------------- teardown
    def close(self) -> None:
        """Kill every process in the nodes and remove every namespace (idempotent)."""
        self._closed = True
        for procs in self._procs.values():
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        _teardown(self.namespaces())
        atexit.unregister(self.close)
        for procs in self._procs.values():
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass

    def __enter__(self) -> NetBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def attach(cls, name_prefix: str) -> NetBed:
        """A handle on a bed another process built (``scripts/cluster.py up``).

        Its :meth:`close` removes that bed; the handle does not remove it at exit.
        """
        names = existing_namespaces(name_prefix)
        nodes = sorted(int(n.rsplit("-n", 1)[1]) for n in names if "-n" in n[len(name_prefix):])
        if not nodes or f"{name_prefix}-br" not in names:
            raise NetBedError(f"no network bed named {name_prefix!r} here; "
                              f"beds: {sorted(beds()) or 'none'}. Start one with "
                              "`scripts/cluster.py up`.")
        bed = cls.__new__(cls)
        bed.nodes, bed.prefix = len(nodes), name_prefix
        shown = _run(["ip", "-n", f"{name_prefix}-n0", "-4", "-o", "addr", "show", "eth0"])
        bed.subnet = shown.split("inet ", 1)[1].split("/")[0].rsplit(".", 1)[0]
        bed._procs = {i: [] for i in range(bed.nodes)}
        bed._closed = False  # no atexit hook: the bed outlives this handle unless closed
        return bed

    def detach(self) -> None:
        """Keep the bed after this process exits (``scripts/cluster.py up``)."""
        atexit.unregister(self.close)

    def _check(self, i: int) -> None:
        if not 0 <= i < self.nodes:
            raise ValueError(f"node {i} is not in this {self.nodes}-node bed; "
                             f"give 0 to {self.nodes - 1}.")

    def _port(self, i: int) -> int:
        self._check(i)
        return i


def beds() -> set[str]:
    """Prefixes of the beds on this machine (their bridge namespaces), from any process."""
    return {n[:-3] for n in existing_namespaces("") if n.endswith("-br")}


def existing_namespaces(prefix: str) -> list[str]:
    """Network namespaces whose names start with ``prefix``."""
    listed = _run(["ip", "netns", "list"])
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def remove_bed(name_prefix: str) -> None:
    """Kill the processes of a bed and remove its namespaces (for ``cluster.py down``)."""
    _teardown(existing_namespaces(f"{name_prefix}-"))


def _teardown(namespaces: list[str]) -> None:
    for ns in namespaces:
        _kill_namespace(ns)
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _kill_namespace(ns: str) -> list[int]:
    """SIGKILL every process inside namespace ``ns``; returns their pids."""
    killed: list[int] = []
    for _ in range(5):  # a dying parent may fork once more: look again
        listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        pids = [int(p) for p in listed.stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return killed


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetBedError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout
