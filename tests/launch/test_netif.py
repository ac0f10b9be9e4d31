"""Choosing the interface and the store host from the route (real sockets, this host)."""

from __future__ import annotations

import logging

import pytest

from gpufleet.launch import LaunchError, netif
from gpufleet.launch.netif import (
    Route,
    choose_socket_ifname,
    is_loopback,
    owns_address,
    resolve_host,
    route_to,
    route_to_peers,
    split_endpoint,
)


def test_route_to_loopback_is_lo_and_owned():
    route = route_to("localhost")
    assert (route.target_ip, route.local_ip, route.ifname) == ("127.0.0.1", "127.0.0.1", "lo")
    assert owns_address("127.0.0.1")
    assert not owns_address("192.0.2.1")  # TEST-NET-1: documentation only, never local


def test_unset_variables_get_the_routing_interface_and_user_settings_win():
    environ: dict[str, str] = {"NCCL_SOCKET_IFNAME": "ib0"}
    route = choose_socket_ifname("127.0.0.1", environ)
    assert route is not None and environ == {"NCCL_SOCKET_IFNAME": "ib0",
                                             "GLOO_SOCKET_IFNAME": "lo"}
    both = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth1"}
    assert choose_socket_ifname("127.0.0.1", both) is None
    assert both == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth1"}


def test_an_address_that_does_not_resolve_says_so():
    with pytest.raises(LaunchError, match=r"does not resolve.*node 0's IP"):
        resolve_host("no-such-host.invalid")


def test_split_endpoint():
    assert split_endpoint("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert split_endpoint("[fe80::1]:7") == ("fe80::1", 7)
    assert split_endpoint("node0") == ("node0", 0)
    with pytest.raises(LaunchError, match="HOST:PORT"):
        split_endpoint("node0:port")


def _routes(monkeypatch, table: dict[str, Route]) -> None:
    """Routes as a node sees them, keyed by host name (the kernel's answer, fixed)."""
    monkeypatch.setattr(netif, "route_to", lambda host: table[host])


def test_master_name_mapped_to_loopback_takes_the_route_to_the_peers(monkeypatch, caplog):
    # Node n1 is the master; Debian's /etc/hosts maps its own name to 127.0.1.1.
    _routes(monkeypatch, {"n1": Route("n1", "127.0.1.1", "127.0.1.1", "lo"),
                          "n2": Route("n2", "10.77.0.3", "10.77.0.2", "veth-n1")})
    environ: dict[str, str] = {}
    with caplog.at_level(logging.INFO, logger="gpufleet.launch.netif"):
        route = choose_socket_ifname("n1", environ, peers=("n1", "n2"))
    assert route is not None and route.local_ip == "10.77.0.2"
    assert environ == {"GLOO_SOCKET_IFNAME": "veth-n1", "NCCL_SOCKET_IFNAME": "veth-n1"}
    assert "=lo" not in caplog.text and "routes to n2 via 10.77.0.2" in caplog.text


def test_loopback_is_kept_when_every_node_is_this_machine(monkeypatch):
    lo = Route("127.0.0.1", "127.0.0.1", "127.0.0.1", "lo")
    _routes(monkeypatch, {"127.0.0.1": lo, "localhost": lo})
    environ: dict[str, str] = {}
    assert route_to_peers("127.0.0.1", ("localhost",)) == lo
    choose_socket_ifname("127.0.0.1", environ, peers=("localhost",))
    assert environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_is_loopback():
    assert is_loopback("127.0.1.1") and is_loopback("::1")
    assert not is_loopback("10.0.0.1") and not is_loopback("not-an-ip")
