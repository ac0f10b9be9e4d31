"""Ending this process's connections to its peers, as a killed peer's kernel would: an
operation waiting on one of them fails at once instead of at its timeout. In-process
recovery uses it to interrupt a collective that gloo cannot abort."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

log = logging.getLogger(__name__)


def cut_connections(addresses: set[str],
                    keep: frozenset[tuple[str, int]] = frozenset()) -> int:
    """Shut down this process's TCP connections to any of ``addresses``, except those
    whose either end is an ``(address, port)`` of ``keep`` (a store this process reaches,
    or serves): an operation waiting on one fails at once. Returns how many were shut
    down."""
    cut = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):  # not a socket (or gone meanwhile)
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM:
                    continue
                peer, port = sock.getpeername()[:2]
                local, local_port = sock.getsockname()[:2]
            except OSError:  # not connected
                continue
            peer, local = peer.removeprefix("::ffff:"), local.removeprefix("::ffff:")
            if peer in addresses and (peer, port) not in keep \
                    and (local, local_port) not in keep:
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
    return cut


def store_endpoint(store: Any) -> frozenset[tuple[str, int]] | None:
    """The addresses and ports the job's ``store`` (a TCPStore, maybe under prefixes, or
    the etcd cluster's members) answers at, or None when they cannot be told."""
    while hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    # The etcd cluster: every member's (gpufleet.launch.etcd_store.EtcdKV).
    endpoints = getattr(store, "endpoints", None) or \
        [(getattr(store, "host", None), getattr(store, "port", None))]
    found = set()
    for host, port in endpoints:
        if not host or not port:
            return None
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return None
        found |= {(str(info[4][0]).removeprefix("::ffff:"), port) for info in infos}
    return frozenset(found)


def cut_old_group(watchdog: Any, store: Any) -> int:
    """Shut down the connections to every node of the group this rank leaves (each
    rank's node address, from the watchdog's heartbeats), the store's kept. Nothing is
    cut when the nodes or the store's address are not known (no watchdog, one node).
    Returns how many were shut down."""
    keep = store_endpoint(store)
    if watchdog is None or keep is None:
        return 0
    try:
        beats = watchdog.heartbeats()
    except Exception as e:  # the store is gone too: the recovery fails on it anyway
        log.debug("no heartbeats to find the old group's nodes: %s", e)
        return 0
    addresses = {beat["addr"] for beat in beats if beat and beat.get("addr")}
    return cut_connections(addresses, keep) if addresses else 0
