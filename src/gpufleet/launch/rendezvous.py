"""Where the elastic agents of a run meet: the rendezvous torchrun would pick for the
launch options, and the node count they name.

Example:
    >>> parse_nnodes("1:4")
    (1, 4)
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpufleet.errors import LaunchError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchPlan:
    """How the elastic agents of a run find each other: the rendezvous torchrun would pick.

    Attributes:
        mode: "standalone" (one node, a private store on a free port), "static" (fixed
            nodes meeting at master_addr:master_port) or "elastic" (a rendezvous endpoint).
        min_nodes: Fewest nodes the run starts with.
        max_nodes: Most nodes the run accepts.
        rdzv_backend: torch rendezvous backend: "c10d", "static", "etcd-v2".
        rdzv_endpoint: host:port of the rendezvous store.
        run_id: Rendezvous id; every node of a run must use the same one.
        rdzv_configs: Extra backend settings (the node rank for "static").

    Example:
        >>> plan = LaunchPlan.resolve(nnodes="2", node_rank=1, master_addr="10.0.0.1",
        ...                           master_port=29500)
        >>> plan.mode, plan.rdzv_endpoint, plan.rdzv_configs
        ('static', '10.0.0.1:29500', {'rank': 1})
    """

    mode: str
    min_nodes: int
    max_nodes: int
    rdzv_backend: str
    rdzv_endpoint: str
    run_id: str
    rdzv_configs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def resolve(cls, *, nnodes: str = "1", node_rank: int = 0, master_addr: str = "127.0.0.1",
                master_port: int = 0, rdzv_endpoint: str = "", rdzv_backend: str = "c10d",
                rdzv_id: str = "") -> LaunchPlan:
        """Choose the rendezvous from the launch options, the way torchrun does."""
        low, high = parse_nnodes(nnodes)
        if rdzv_endpoint and rdzv_backend != "static":
            if high > 1 and not rdzv_id:
                raise LaunchError(f"A multi-node run ({nnodes} nodes) at {rdzv_endpoint} needs "
                                  "the same --rdzv-id on every node. Pass --rdzv-id NAME.")
            return cls("elastic", low, high, rdzv_backend, rdzv_endpoint,
                       rdzv_id or uuid.uuid4().hex)
        if not rdzv_endpoint and high == 1:
            # torchrun --standalone: the store binds port 0, so runs never collide.
            if master_port:
                logger.info("one node: the rendezvous picks its own port; master_port=%d is "
                            "only used by multi-node runs", master_port)
            return cls("standalone", 1, 1, "c10d", "localhost:0", uuid.uuid4().hex)
        if low != high:
            raise LaunchError(f"dist.nnodes = {nnodes!r} asks for an elastic node count, which "
                              "needs a rendezvous endpoint. Pass --rdzv-endpoint HOST:PORT and "
                              "--rdzv-id NAME, or a fixed --nnodes N.")
        if not 0 <= node_rank < high:
            raise LaunchError(f"dist.node_rank = {node_rank} is not a node of a {high}-node run."
                              f" Give each node a --node-rank from 0 to {high - 1}.")
        if not rdzv_endpoint and master_port == 0:
            raise LaunchError(f"A static {high}-node run needs a fixed port on node 0 that all "
                              "nodes know. Pass --master-port PORT (e.g. 29500) on every node.")
        host = f"[{master_addr}]" if ":" in master_addr else master_addr
        endpoint = rdzv_endpoint or f"{host}:{master_port}"
        return cls("static", high, high, "static", endpoint, rdzv_id or "gpufleet",
                   {"rank": node_rank})


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """Read a node count, "N" or "MIN:MAX", as ``(min, max)``.

    Example:
        >>> parse_nnodes("2"), parse_nnodes("1:4")
        ((2, 2), (1, 4))
    """
    parts = str(nnodes).split(":")
    if not (1 <= len(parts) <= 2 and all(p.strip().isdigit() for p in parts)):
        raise LaunchError(f"dist.nnodes = {nnodes!r} is not a node count. "
                          "Give N (e.g. '2') or MIN:MAX (e.g. '1:4').")
    low, high = int(parts[0]), int(parts[-1])
    if not 1 <= low <= high:
        raise LaunchError(f"dist.nnodes = {nnodes!r}: need 1 <= MIN <= MAX. "
                          "Give e.g. '2' or '1:4'.")
    return low, high
