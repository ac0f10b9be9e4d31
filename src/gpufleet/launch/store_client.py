"""A training node's side of a rendezvous store it does not host.

Two things an agent must settle before torch's c10d rendezvous takes over:

* **Is anyone there?** Nothing listening at ``--rdzv-endpoint`` would otherwise surface
  as torch's "connection to the C10d store has failed" after a minute; here the wait is
  logged, and its end names the endpoint and the fix.
* **Which rendezvous id?** torch closes a run's rendezvous when the run ends (finished,
  failed or stopped), for good: a store that outlives runs (``gpufleet store``) refuses
  the next start under the same ``--rdzv-id`` (``RendezvousClosedError``), which a
  requeued or resumed job needs. Each id has a generation in the store; a start that
  finds its rendezvous closed moves every node to the next one (``ID``, ``ID.1``,
  ``ID.2``...) with one compare-and-set, so all nodes of the new start agree.

Example:
    >>> torch_run_id("exp1", 0), torch_run_id("exp1", 2)
    ('exp1', 'exp1.2')
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gpufleet.errors import LaunchError
from gpufleet.launch.netif import split_endpoint

logger = logging.getLogger(__name__)

_WARN_AFTER_S = 5.0  # say what it waits for once it has waited this long


def torch_run_id(rdzv_id: str, generation: int) -> str:
    """The rendezvous id torch is given for ``rdzv_id`` at ``generation``."""
    return rdzv_id if generation == 0 else f"{rdzv_id}.{generation}"


def wait_for_store(endpoint: str, timeout_s: float, poll_s: float = 0.5) -> None:
    """Return once something accepts connections at ``endpoint`` ("host:port").

    Raises:
        LaunchError: nothing did within ``timeout_s`` seconds; the message names the
            endpoint, the last error, and how to start the store there.
    """
    host, port = split_endpoint(endpoint)
    start = warned = time.monotonic()
    last = ""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(poll_s, 1.0)):
                return
        except OSError as err:
            last = err.strerror or str(err)
        waited = time.monotonic() - start
        if waited >= timeout_s:
            break
        if warned == start and waited >= _WARN_AFTER_S:
            warned = time.monotonic()
            logger.warning("nothing answers at the rendezvous endpoint %s yet (%s); waiting "
                           "up to %.0f s for its store", endpoint, last, timeout_s)
        time.sleep(poll_s)
    raise LaunchError(
        f"Nothing answers at the rendezvous endpoint {endpoint} ({last}; tried for "
        f"{timeout_s:.0f} s), and this node does not host the store (no interface here has "
        f"{host}'s address). Start the store there first (on {host}: `gpufleet store "
        f"--port {port}`, or start the training node that owns {host} first), or fix "
        "--rdzv-endpoint: every node must give the same address, reachable from each "
        "(`gpufleet doctor --rdzv-endpoint HOST:PORT` shows the route).")


class RunGenerations:
    """The generation of a rendezvous id, kept in the store at ``endpoint``.

    Args:
        endpoint: "host:port" of a store this node does not host.
        rdzv_id: The id every node of the run was given.
        timeout_s: Seconds a store call may take.
    """

    def __init__(self, endpoint: str, rdzv_id: str, timeout_s: float) -> None:
        host, port = split_endpoint(endpoint)
        self.rdzv_id = rdzv_id
        self._key = f"gpufleet.rdzv_generation.{rdzv_id}"
        self._store: Any = dist.TCPStore(host, port, is_master=False,
                                         timeout=timedelta(seconds=timeout_s))

    def current(self) -> int:
        """The generation starts use now (0 for an id the store has not seen)."""
        return int(self._store.add(self._key, 0))  # add(0): an atomic read, 0 if new

    def after_closed(self, generation: int) -> int:
        """The generation to use once ``generation``'s rendezvous was found closed: the
        next one, moved to by this node or already by another node of the same start."""
        now = self._store.compare_set(self._key, str(generation), str(generation + 1))
        moved = int(now)
        logger.info("the rendezvous %r at this store was closed by a run that ended; this "
                    "start uses %r", torch_run_id(self.rdzv_id, generation),
                    torch_run_id(self.rdzv_id, moved))
        return moved
