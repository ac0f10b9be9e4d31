"""Health and metadata latency while the server parses large JSON bodies: parsed on the
event loop (the old way) against parsed in the server's parse processes (now).

One server per mode runs in a thread of this process; a client thread sends ~30 MiB JSON
inference requests one after another while the main thread polls /v2/health/live and
/v2/models/NAME every 20 ms. Modes alternate round by round (noisy shared machines).
Reported per mode: health round-trip p50, p99 and max over all rounds, and the mean
duration of the large request.

Usage:
    python benchmarks/serve_health.py              # 3 rounds per mode
    python benchmarks/serve_health.py --rounds 5 --floats 3300000
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time

import numpy as np

import gpufleet.serve.app as app
from gpufleet.core.machine import machine_summary
from gpufleet.serve.app import ServeOptions, create_app
from gpufleet.serve.model import TensorSpec, from_module
from gpufleet.serve.runner import BackgroundServer


def _get(address: str, path: str, body: bytes | None = None) -> int:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST" if body else "GET", path, body=body)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def one_round(inline: bool, body: bytes) -> tuple[list[float], float]:
    """Health round trips (s) during one large request, and that request's duration."""
    app.PARSE_INLINE_BYTES = 10**12 if inline else 256 * 1024
    model = from_module("total", lambda x: x.sum(axis=1, keepdims=True),
                        [TensorSpec("x", "FP32", (-1,))], "cpu")
    options = ServeOptions(max_body_bytes=64 * 2**20, max_inflight_bytes=128 * 2**20)
    with BackgroundServer(create_app([model], options)) as srv:
        _get(srv.address, "/v2/models/total/infer", body)  # warm: parse processes start
        done: dict = {}

        def big() -> None:
            start = time.perf_counter()
            done["status"] = _get(srv.address, "/v2/models/total/infer", body)
            done["s"] = time.perf_counter() - start

        thread = threading.Thread(target=big)
        thread.start()
        rtts = []
        while thread.is_alive():
            for path in ("/v2/health/live", "/v2/models/total"):
                start = time.perf_counter()
                assert _get(srv.address, path) == 200
                rtts.append(time.perf_counter() - start)
            time.sleep(0.02)
        thread.join()
    assert done["status"] == 200
    return rtts, done["s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floats", type=int, default=3_300_000)
    args = parser.parse_args()
    data = np.random.default_rng(0).random(args.floats).round(6).tolist()
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32",
                                   "shape": [1, args.floats], "data": data}]}).encode()
    print(machine_summary())
    print(f"body: {len(body) / 2**20:.1f} MiB of JSON, {args.rounds} rounds per mode")
    results: dict[str, tuple[list[float], list[float]]] = {"inline": ([], []),
                                                           "pool": ([], [])}
    for _ in range(args.rounds):
        for mode in ("inline", "pool"):  # interleaved
            rtts, seconds = one_round(mode == "inline", body)
            results[mode][0].extend(rtts)
            results[mode][1].append(seconds)
    print(f"{'parse':<8} {'health p50 ms':>14} {'p99 ms':>8} {'max ms':>8} "
          f"{'big request s':>14}")
    for mode, (rtts, secs) in results.items():
        rtts = sorted(rtts)
        p99 = rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))]
        print(f"{mode:<8} {statistics.median(rtts) * 1e3:>14.1f} {p99 * 1e3:>8.1f} "
              f"{rtts[-1] * 1e3:>8.1f} {statistics.mean(secs):>14.2f}")


if __name__ == "__main__":
    main()
