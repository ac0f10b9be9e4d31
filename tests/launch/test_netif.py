"""Choosing the interface and the store host from the route (real sockets, this host)."""

from __future__ import annotations

import pytest

from gpufleet.launch import LaunchError
from gpufleet.launch.netif import (
    choose_socket_ifname,
    owns_address,
    resolve_host,
    route_to,
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
