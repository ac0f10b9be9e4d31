"""A bare HTTP client for requests tritonclient would refuse to send."""

import http.client
import json
from urllib.parse import urlsplit


def request(url: str, method: str, path: str, body: bytes = b"",
            headers: dict | None = None) -> tuple[int, dict, bytes]:
    """Send one request on a fresh connection; returns (status, headers, body)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def error_of(body: bytes) -> str:
    """The ``error`` message of a JSON error body."""
    return json.loads(body)["error"]
