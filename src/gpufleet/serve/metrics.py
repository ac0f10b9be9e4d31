"""Server metrics in the Prometheus text exposition format, through ``prometheus_client``.

Each server keeps its own registry (two servers in one process do not share counts).
The server exposes them at ``GET /metrics``:

- ``gpufleet_inference_requests_total{model}``: inference requests received;
- ``gpufleet_inference_failures_total{model, reason}``: requests answered with an error
  (``reason`` is ``request`` for a bad request, ``model`` when the model raised);
- ``gpufleet_inference_request_seconds{model}``: end-to-end latency histogram;
- ``gpufleet_inference_queue_seconds{model}``: time waiting for a batch;
- ``gpufleet_inference_compute_seconds{model}``: time in the model per batch;
- ``gpufleet_inference_batch_size{model}``: rows per executed batch.

Example:
    >>> m = ServerMetrics()
    >>> m.requests.inc("gpt")
    >>> 'gpufleet_inference_requests_total{model="gpt"} 1.0' in m.render()
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import prometheus_client as prom

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONTENT_TYPE = prom.CONTENT_TYPE_LATEST  # text/plain; version=0.0.4; charset=utf-8


class Counter:
    """A monotonically increasing count per label set (a ``prometheus_client.Counter``).

    ``name`` ends in ``_total``, the exposed name, as Prometheus counters do.
    """

    def __init__(self, registry: prom.CollectorRegistry, name: str, help: str,
                 labels: Sequence[str] = ()) -> None:
        self.name, self._registry, self._labels = name, registry, tuple(labels)
        self._metric = prom.Counter(name.removesuffix("_total"), help, self._labels,
                                    registry=registry)

    def inc(self, *labels: str, by: float = 1.0) -> None:
        self._metric.labels(*labels).inc(by)

    def value(self, *labels: str) -> float:
        return self._registry.get_sample_value(self.name, dict(zip(self._labels, labels))) or 0.0


class Histogram:
    """Observations counted into cumulative buckets (a ``prometheus_client.Histogram``)."""

    def __init__(self, registry: prom.CollectorRegistry, name: str, help: str,
                 labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name, self._registry, self._labels = name, registry, tuple(labels)
        self._metric = prom.Histogram(name, help, self._labels, buckets=tuple(buckets),
                                      registry=registry)

    def observe(self, value: float, *labels: str) -> None:
        self._metric.labels(*labels).observe(value)

    def count(self, *labels: str) -> int:
        found = self._registry.get_sample_value(f"{self.name}_count",
                                                dict(zip(self._labels, labels)))
        return int(found or 0)


class ServerMetrics:
    """Every metric the server keeps; ``render()`` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self.registry = reg = prom.CollectorRegistry()
        self.requests = Counter(reg, "gpufleet_inference_requests_total",
                                "Inference requests received.", ("model",))
        self.failures = Counter(reg, "gpufleet_inference_failures_total",
                                "Inference requests answered with an error.",
                                ("model", "reason"))
        self.latency = Histogram(reg, "gpufleet_inference_request_seconds",
                                 "Inference request latency, body read to response.",
                                 ("model",))
        self.queue = Histogram(reg, "gpufleet_inference_queue_seconds",
                               "Time a request waited in the batching queue.", ("model",))
        self.compute = Histogram(reg, "gpufleet_inference_compute_seconds",
                                 "Time the model took per executed batch.", ("model",))
        self.batch_size = Histogram(reg, "gpufleet_inference_batch_size",
                                    "Rows (samples) per executed batch.", ("model",),
                                    buckets=BATCH_BUCKETS)

    def render(self) -> str:
        return prom.generate_latest(self.registry).decode()
