"""Ports for tests that must reach nothing: held for the test's whole use.

A port picked free and then released can be taken meanwhile by a rank of a test running
beside this one (gloo listens on ports the kernel hands out); a test that connects there
"to nobody" would then reach that rank and break its connection mesh.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` whose connections are refused: bound and never listening, held
    for the ``with`` block so that no other process can listen there."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        yield sock.getsockname()[1]


@contextlib.contextmanager
def refused_endpoint(host: str = "127.0.0.1") -> Iterator[str]:
    """``host:port`` of :func:`refused_port`."""
    with refused_port(host) as port:
        yield f"{host}:{port}"
