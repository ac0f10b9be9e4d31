"""``gpufleet store``: the rendezvous store of elastic runs, on a host that does not train.

With the c10d rendezvous every agent of a run meets in one key-value store (torch's
``TCPStore``) at ``--rdzv-endpoint``. Left to the training nodes, the node that owns the
endpoint address hosts it in its launcher, and losing that node ends the run: no agent
can re-rendezvous without the store. Run the store on a host of your choice (a login
node, a small always-on VM) instead, and point every node at it: no training node owns
the address, so every agent is a client, and losing any one training node is a node
loss like any other.

    gpufleet store --port 29400                 # on the store host; runs until stopped
    gpufleet train --nnodes 1:4 --rdzv-endpoint STORE_HOST:29400 --rdzv-id exp1 ...

The store is torch's own server (``TCPStore(is_master=True, multi_tenant=True)``); one
serves any number of runs, each under its own ``--rdzv-id``. It keeps the rendezvous
state only: the ranks' process group still meets in a store their rank 0 hosts, made
new at every restart. Only the standard library is imported at the top, so building
the CLI's parser stays fast; torch is imported when the store starts.

Example:
    >>> endpoint_hint(29400, ["10.0.0.5"])
    '--rdzv-endpoint 10.0.0.5:29400'
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29400  # torch's c10d rendezvous default


def serve_store(port: int = DEFAULT_PORT, *, stop: threading.Event | None = None,
                ready: Callable[[int], None] | None = None) -> None:
    """Serve a c10d rendezvous store on ``port`` (all interfaces) until ``stop`` is set.

    Args:
        port: TCP port to listen on; 0 picks a free one (``ready`` gets it).
        stop: Ends the store when set (default: runs until the process ends).
        ready: Called once with the port the store listens on.

    Raises:
        OSError: the port cannot be bound (the message names it and the fix).

    Example:
        >>> stop = threading.Event()
        >>> threading.Thread(target=serve_store, args=(0,), daemon=True,  # doctest: +SKIP
        ...                  kwargs={"stop": stop, "ready": print}).start()
    """
    # Deferred: torch is heavy, and only the store itself needs it.
    import torch.distributed as dist

    stop = stop or threading.Event()
    try:
        # A server that waits for no worker; clients (the agents) come and go.
        store = dist.TCPStore("0.0.0.0", port, None, True, timedelta(seconds=60),
                              wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, dist.DistNetworkError) as err:
        raise OSError(f"cannot listen on port {port} ({err}). Another process holds it "
                      "(a store already running here? `ss -ltnp | grep :PORT` names it): "
                      "stop it, or choose another --port and give the nodes that one.") \
            from None
    logger.info("rendezvous store listening on port %d", store.port)
    if ready is not None:
        ready(store.port)
    stop.wait()
    del store  # the server closes with its last reference


def endpoint_hint(port: int, addresses: Sequence[str]) -> str:
    """The ``--rdzv-endpoint`` flag for this host: its first address, else its name."""
    host = addresses[0] if addresses else socket.gethostname()
    host = f"[{host}]" if ":" in host else host
    return f"--rdzv-endpoint {host}:{port}"


def host_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback, the ones the nodes can reach."""
    import psutil  # deferred: the CLI's parser imports this module

    found = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                found.append(addr.address)
    return found


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet store`` to the CLI's subparsers."""
    p = sub.add_parser(
        "store", help="serve the rendezvous store of elastic runs from a host that does "
                      "not train (so losing any training node is survivable)",
        description="Serve a c10d rendezvous store (torch's TCPStore) until stopped "
                    "(Ctrl-C or SIGTERM). Start the training nodes with --rdzv-endpoint "
                    "THIS_HOST:PORT and one --rdzv-id per run: every node is then a "
                    "client, and the run survives losing any of them.")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"TCP port (default {DEFAULT_PORT}; 0: a free one, printed)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; print the endpoint the nodes should use."""
    if not 0 <= args.port < 65536:
        print(f"gpufleet: error: --port {args.port} is not a TCP port. Give 1 to 65535, "
              "or 0 for a free one.", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def announce(port: int) -> None:
        print(f"gpufleet store: listening on port {port}; start every node with "
              f"{endpoint_hint(port, host_addresses())} --rdzv-id RUN_NAME "
              "(Ctrl-C stops the store)", flush=True)

    try:
        serve_store(args.port, stop=stop, ready=announce)
    except OSError as err:
        print(f"gpufleet: error: {err}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("gpufleet store: stopped", flush=True)
    return 0
