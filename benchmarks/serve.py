"""Serving throughput and latency: dynamic batching on vs off, at 1, 16 and 64 clients.

Starts ``gpufleet``'s v2 server in a subprocess on 127.0.0.1 (this script, in server
mode), then drives it with closed-loop clients from one asyncio load generator on the
same machine: every client sends a request, waits for the answer, sends the next. Each
client holds one keep-alive connection. Requests use the binary tensor extension
(tokens in, logits out as binary), as tritonclient does by default.

Batching off is ``--max-batch-size 1``; on is ``--max-batch-size 64`` with a
``--max-queue-delay-us`` (default 1000). Reported per setting: requests/s, p50 and p99
latency, and the mean executed batch size (from the server's /metrics).

Models:
- ``gpt``: the built-in GPT (4 layers, width 128, 32-token requests by default, random weights) on
  the CPU. Its cost grows with the batch, so batching only saves the per-call overhead.
- ``gpt-5ms``: the same GPT plus a fixed 5 ms wait per model call, standing in for what
  an accelerator adds per call (kernel launches, host-device copies and the sync) while
  the CPU is free; this is where dynamic batching pays on GPU servers.

Usage:
    python benchmarks/serve.py                      # both models, 5 s per point
    python benchmarks/serve.py --models gpt --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

from gpufleet.core.machine import cpu_model

CLIENTS = (1, 16, 64)


def build_model(kind: str):
    import numpy as np
    import torch

    from gpufleet.models import build_gpt
    from gpufleet.serve.model import TensorSpec, from_module

    torch.manual_seed(0)
    gpt = build_gpt(n_layer=4, n_head=4, n_embd=128, block_size=64).eval()
    spec = [TensorSpec("INPUT__0", "INT64", (-1,))]
    if kind == "gpt":
        return from_module("gpt", gpt, spec, "cpu")
    if kind == "gpt-5ms":
        served = from_module("gpt", gpt, spec, "cpu")
        inner = served.fn

        def with_device_latency(arrays: list[np.ndarray]) -> list[np.ndarray]:
            out = inner(arrays)
            time.sleep(0.005)  # the fixed per-call wait; the CPU is free meanwhile
            return out

        served.fn = with_device_latency
        return served
    raise SystemExit(f"unknown model {kind!r}; use gpt or gpt-5ms")


def server_main(args: argparse.Namespace) -> None:
    import torch

    from gpufleet.serve.app import ServeOptions, create_app
    from gpufleet.serve.runner import bind, serve_forever, url_of

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    model = build_model(args.model)
    sock = bind("127.0.0.1", 0)
    print(url_of(sock), flush=True)
    serve_forever(create_app([model], ServeOptions(args.max_batch_size, args.delay_us)), sock)


def _request_bytes(port: int, seed: int, seq: int) -> bytes:
    import numpy as np

    tokens = np.random.default_rng(seed).integers(0, 256, (1, seq), dtype=np.int64).tobytes()
    head = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "INT64", "shape": [1, seq],
                                   "parameters": {"binary_data_size": len(tokens)}}],
                       "parameters": {"binary_data_output": True}}).encode()
    body = head + tokens
    return (f"POST /v2/models/gpt/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _client(port: int, seed: int, seq: int, start: float, stop: float,
                  latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = _request_bytes(port, seed, seq)
    try:
        while (now := time.perf_counter()) < stop:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"server answered {head[:40]!r}")
            length = int(re.search(rb"(?im)^content-length: (\d+)", head).group(1))
            await reader.readexactly(length)
            if now >= start:  # requests sent during the warm-up are not counted
                latencies.append(time.perf_counter() - now)
    finally:
        writer.close()


def _http_get(port: int, path: str) -> str:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def _batches(port: int) -> tuple[float, float]:
    text = _http_get(port, "/metrics")
    count = re.search(r'batch_size_count\{model="gpt"\} (\S+)', text)
    total = re.search(r'batch_size_sum\{model="gpt"\} (\S+)', text)
    return (float(count.group(1)), float(total.group(1))) if count else (0.0, 0.0)


def measure(port: int, clients: int, duration: float, warmup: float, seq: int = 32) -> dict:
    latencies: list[float] = []
    before = _batches(port)
    start = time.perf_counter() + warmup
    stop = start + duration

    async def run_all() -> None:
        await asyncio.gather(*(_client(port, i, seq, start, stop, latencies)
                               for i in range(clients)))

    asyncio.run(run_all())
    after = _batches(port)
    latencies.sort()
    rows = after[1] - before[1]
    return {"rps": len(latencies) / duration,
            "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "mean_batch": rows / max(1.0, after[0] - before[0])}


def run_server(model: str, max_batch_size: int, delay_us: int,
               torch_threads: int) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, __file__, "--server", "--model", model,
                             "--max-batch-size", str(max_batch_size), "--delay-us",
                             str(delay_us), "--torch-threads", str(torch_threads)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("http://"):
        proc.kill()
        raise SystemExit("the server did not start")
    return proc, int(line.strip().rsplit(":", 1)[1])


def machine(torch_threads: int) -> str:
    import torch

    torch_threads = torch_threads or torch.get_num_threads()
    return (f"{cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, "
            f"Python {platform.python_version()}; server torch threads {torch_threads}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,gpt-5ms")
    p.add_argument("--seq", type=int, default=32, help="tokens per request (max 64)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per point")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
    p.add_argument("--delay-us", type=int, default=1000, help="queue delay with batching on")
    p.add_argument("--max-batch-size", type=int, default=64, help="batch limit when on")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch threads in the server (default 0: torch's default, one per "
                        "core, as `gpufleet serve` runs)")
    p.add_argument("--server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.server:
        server_main(args)
        return
    print(f"machine: {machine(args.torch_threads)}")
    print(f"requests: INT64 [1, {args.seq}] tokens in, FP32 [1, {args.seq}, 256] logits out, "
          "binary; "
          f"{args.duration:g} s per point after {args.warmup:g} s warm-up")
    print(f"{'model':8} {'batching':22} {'clients':>7} {'req/s':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'mean batch':>10}")
    results = {}
    for model in args.models.split(","):
        settings = {"off": (1, 0), f"on (max {args.max_batch_size}, {args.delay_us} us)":
                    (args.max_batch_size, args.delay_us)}
        for label, (mbs, delay) in settings.items():
            proc, port = run_server(model, mbs, delay, args.torch_threads)
            try:
                for clients in CLIENTS:
                    r = measure(port, clients, args.duration, args.warmup, args.seq)
                    results[(model, label.split()[0], clients)] = r
                    print(f"{model:8} {label:22} {clients:7d} {r['rps']:8.1f} "
                          f"{r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['mean_batch']:10.2f}",
                          flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    for model in args.models.split(","):
        for clients in CLIENTS:
            on, off = results[(model, "on", clients)], results[(model, "off", clients)]
            print(f"{model}: {clients} clients: batching on / off = "
                  f"{on['rps'] / off['rps']:.2f}x throughput")


if __name__ == "__main__":
    main()
