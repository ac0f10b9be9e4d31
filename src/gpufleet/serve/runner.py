"""Run the ASGI app with uvicorn: in the foreground (the CLI) or in a background thread.

The socket is bound before uvicorn starts, so port 0 works (the OS picks a free port) and
the real address is known up front.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted sockets whose proto
    # says TCP, and without it Nagle + delayed ACKs add ~40 ms to binary responses.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def make_server(app: Any, log_level: str = "warning") -> Any:
    """A uvicorn server for ``app``; run it with ``server.run(sockets=[sock])``."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve_forever(app: Any, sock: socket.socket, log_level: str = "warning") -> None:
    """Serve ``app`` on ``sock`` until interrupted (Ctrl-C / SIGTERM)."""
    make_server(app, log_level).run(sockets=[sock])


class BackgroundServer:
    """Serve an app from a thread of this process; a context manager that stops it.

    Example:
        >>> with BackgroundServer(app) as server:  # doctest: +SKIP
        ...     client = tritonclient.http.InferenceServerClient(server.address)
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.address = self.url.removeprefix("http://")  # what tritonclient takes
        self._server = make_server(app)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(15)
        self.sock.close()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
