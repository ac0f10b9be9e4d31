"""How fast each node reaches the others: a short probe at the start of a multi-node run,
and the words the diagnosis uses to name the node behind a slow link.

:func:`probe_node_links` runs on every rank (it is collective) when the run spans more
than one node. The first rank of each node (its leader) swaps a message with the leaders
of other nodes, one pair at a time while everybody else waits: first a few bytes (the
round trip), then 64 KB, 256 KB and 1 MB until one swap takes :data:`ENOUGH_S` (a
slow link stops after its first size or two; a fast pair swaps about 1.3 MB each way in
all: fast links are told apart only roughly, which is enough to single out a slow
node). Pairs: every pair of nodes up to 4 nodes; beyond that each node with the
first three (about 3 pairs a node). A node's *reach* is its fastest link to any other:
a node whose own link is slow is slow towards every peer, so even its best link is slow,
while every other node has at least one pair without it (three nodes or more).

:func:`link_sentence` turns the result into the sentence the communication-bound
finding ends with: the node whose reach is far below the others' (node rank, address,
measured rate against theirs), the one link when there are only two nodes (the probe
cannot tell which end is slow), and nothing about any node when the links are alike.

Example:
    >>> links = {"nodes": [{"node": 0, "addr": "10.0.0.1", "mbit_s": 9000.0},
    ...                    {"node": 1, "addr": "10.0.0.2", "mbit_s": 19.5},
    ...                    {"node": 2, "addr": "10.0.0.3", "mbit_s": 9500.0}]}
    >>> [n["node"] for n in slow_nodes(links)]
    [1]
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

from gpufleet.core.collectives import timed_swap

log = logging.getLogger(__name__)

SIZES = (64 << 10, 256 << 10, 1 << 20)  # bytes per swap, smallest first
ENOUGH_S = 0.1  # a swap this long measures the rate well enough; larger sizes are skipped
SLOW_SHARE = 0.25  # a node is slow when its reach is under this share of the others'
_HUBS = 3  # beyond this many nodes, each node is paired with the first _HUBS only
_ROUND_TRIPS = 3  # tiny swaps per pair; the first sets the connection up and is dropped


def probe_node_links(env: Any, enabled: bool, device: Any) -> dict[str, Any]:
    """Time the links between the nodes of a multi-node run (see the module docs).

    COLLECTIVE: call it on every rank or on none. It does nothing (and returns ``{}``)
    when ``enabled`` is false, without a process group, or on one node; these are the
    same on every rank (``enabled`` must be: the resolved config is rank 0's).

    Args:
        env: this rank's :class:`~gpufleet.launch.DistEnv`.
        enabled: ``monitor.link_probe``.
        device: the rank's device (the probe's tensors live there, as the gradients do).

    Returns:
        ``{"nodes": [{"node", "addr", "mbit_s", "latency_ms"}], "pairs": [{"nodes",
        "addr", "mbit_s", "latency_ms", "bytes"}], "seconds"}``, the same on every rank
        but ``seconds`` (the probe's cost on this rank's clock); ``mbit_s`` counts both
        directions of a swap, ``latency_ms`` is a round trip.
    """
    from gpufleet.launch import gather_objects, is_initialized
    from gpufleet.launch.netif import node_address

    if not enabled or not is_initialized() or env.world_size <= env.local_world_size:
        return {}
    start = time.perf_counter()
    who = gather_objects((env.node_rank, node_address(env)))  # COLLECTIVE
    leaders: dict[int, int] = {}  # node rank -> its first global rank
    addrs: dict[int, str] = {}
    for rank, (node, addr) in enumerate(who):
        leaders.setdefault(node, rank)
        addrs.setdefault(node, addr)
    nodes = sorted(leaders)
    if len(nodes) < 2:  # the launcher gave every rank one node rank (the same everywhere)
        return {}
    pairs = probe_pairs(nodes)
    latency = _round_trips([(leaders[a], leaders[b]) for a, b in pairs], device)
    rates = _rates([(leaders[a], leaders[b]) for a, b in pairs], device)
    out = {"pairs": [{"nodes": [a, b], "addr": [addrs[a], addrs[b]], "bytes": size,
                      "mbit_s": 2 * size * 8 / seconds / 1e6, "latency_ms": lat * 1e3}
                     for (a, b), (size, seconds), lat in zip(pairs, rates, latency)]}
    out["nodes"] = [_reach(node, addrs[node], out["pairs"]) for node in nodes]
    out["seconds"] = time.perf_counter() - start
    if env.is_main:
        log.info("link probe (%.2f s): %s", out["seconds"], "; ".join(
            f"node {n['node']} ({n['addr'] or '?'}) reaches the others at up to "
            f"{rate_text(n['mbit_s'])}, {n['latency_ms']:.2f} ms round trip"
            for n in out["nodes"]))
    return out


def probe_pairs(nodes: list[int]) -> list[tuple[int, int]]:
    """The node pairs the probe times: every pair among the first three nodes, and each
    later node with each of those three (all pairs up to four nodes).

    Example:
        >>> probe_pairs([0, 1, 2])
        [(0, 1), (0, 2), (1, 2)]
        >>> len(probe_pairs(list(range(10))))  # 3 + 3 x 7, not 45
        24
    """
    return [(a, b) for i, a in enumerate(nodes[:_HUBS]) for b in nodes[i + 1:]]


def _round_trips(pairs: list[tuple[int, int]], device: Any) -> list[float]:
    """The shortest round trip of a 4-byte swap per pair (the first swap, which may set
    the connection up, left out)."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(1, dtype=torch.float32, device=device)
    times = torch.tensor([[timed_swap(x, a, b) for a, b in pairs]
                          for _ in range(_ROUND_TRIPS)], dtype=torch.float64, device=device)
    dist.all_reduce(times)  # COLLECTIVE: each time is non-zero on its pair's first rank only
    return times[1:].min(dim=0).values.tolist()


def _rates(pairs: list[tuple[int, int]], device: Any) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of each pair's largest swap: sizes grow until a swap takes
    :data:`ENOUGH_S`. Every rank knows every time (an all-reduce after each size), so
    all agree which pairs go on to the next size."""
    import torch
    import torch.distributed as dist

    done: list[tuple[int, float] | None] = [None] * len(pairs)
    for size in SIZES:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        times = torch.tensor([timed_swap(x, a, b) if done[i] is None else 0.0
                              for i, (a, b) in enumerate(pairs)],
                             dtype=torch.float64, device=device)
        dist.all_reduce(times)  # COLLECTIVE: every rank sees every pair's time
        for i, seconds in enumerate(times.tolist()):
            if done[i] is None and (seconds >= ENOUGH_S or size == SIZES[-1]):
                done[i] = (size, seconds)
        if all(d is not None for d in done):
            break
    return [d for d in done if d is not None]


def _reach(node: int, addr: str, pairs: list[dict[str, Any]]) -> dict[str, Any]:
    mine = [p for p in pairs if node in p["nodes"]]
    return {"node": node, "addr": addr, "mbit_s": max(p["mbit_s"] for p in mine),
            "latency_ms": min(p["latency_ms"] for p in mine)}


def slow_nodes(links: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes whose reach (fastest link) is under :data:`SLOW_SHARE` of the median
    reach of the other nodes; empty with fewer than three nodes (one link cannot say
    which end is slow) or when the links are alike."""
    nodes = links.get("nodes") or []
    if len(nodes) < 3:
        return []
    slow = []
    for n in nodes:
        others = statistics.median(o["mbit_s"] for o in nodes if o is not n)
        if n["mbit_s"] < SLOW_SHARE * others:
            slow.append(n)
    return slow if len(slow) < len(nodes) else []


def link_sentence(links: dict[str, Any]) -> str:
    """What the link probe says about the run's links, as a sentence ("" without a
    probe). Names the slow node(s) when one stands out (see :func:`slow_nodes`)."""
    nodes = links.get("nodes") or []
    if len(nodes) < 2:
        return ""
    if len(nodes) == 2:
        (pair,) = links["pairs"]
        a, b = nodes
        return (f"The link probe at the start measured the link between node {a['node']} "
                f"({a['addr'] or '?'}) and node {b['node']} ({b['addr'] or '?'}) at "
                f"{rate_text(pair['mbit_s'])}, {pair['latency_ms']:.2f} ms round trip (with "
                "two nodes it cannot tell which end is slow).")
    slow = slow_nodes(links)
    if not slow:
        rates = [n["mbit_s"] for n in nodes]
        return (f"The link probe at the start found the {len(nodes)} nodes alike: each "
                f"reaches the others at up to {rate_text(min(rates))} to "
                f"{rate_text(max(rates))}, so no one node's link holds the run back.")
    others = [n for n in nodes if n not in slow]
    named = " and ".join(f"node {n['node']} ({n['addr'] or '?'}) reaches the others at "
                         f"{rate_text(n['mbit_s'])} at best" for n in slow)
    rest = ", ".join(f"node {n['node']} at {rate_text(n['mbit_s'])}" for n in others[:4])
    more = f" and {len(others) - 4} more" if len(others) > 4 else ""
    return (f"The link probe at the start found the slow link: {named}; {rest}{more}. "
            "Every all-reduce runs at the slowest link's pace.")


def slow_node_fix(links: dict[str, Any]) -> str:
    """The fix for the node(s) :func:`slow_nodes` names, or ""."""
    slow = slow_nodes(links)
    if not slow:
        return ""
    names = " and ".join(f"node {n['node']} ({n['addr'] or '?'})" for n in slow)
    return (f"check {names}: its interface speed and errors (`ethtool`, `ip -s link`), "
            "traffic shaping (`tc qdisc`) and its switch port, or run without it")


def rate_text(mbit_s: float) -> str:
    """A link rate in the unit that reads best.

    Example:
        >>> rate_text(19.46), rate_text(9400.0)
        ('19.5 Mbit/s', '9.4 Gbit/s')
    """
    if mbit_s >= 1000:
        return f"{mbit_s / 1000:,.1f} Gbit/s"
    return f"{mbit_s:,.1f} Mbit/s"
