"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Counters and histograms keyed by label values, safe to update from any thread. The
server exposes them at ``GET /metrics``:

- ``gpufleet_inference_requests_total{model}``: inference requests received;
- ``gpufleet_inference_failures_total{model, reason}``: requests answered with an error
  (``reason`` is ``request`` for a bad request, ``model`` when the model raised);
- ``gpufleet_inference_request_seconds{model}``: end-to-end latency histogram;
- ``gpufleet_inference_queue_seconds{model}``: time waiting for a batch;
- ``gpufleet_inference_compute_seconds{model}``: time in the model per batch;
- ``gpufleet_inference_batch_size{model}``: rows per executed batch.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


class Counter:
    """A monotonically increasing count per label set.

    Example:
        >>> c = Counter("requests_total", "Requests.", ("model",))
        >>> c.inc("gpt")
        >>> c.render().splitlines()[-1]
        'requests_total{model="gpt"} 1'
    """

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, *labels: str, by: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + by

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            for labels, v in sorted(self._values.items()):
                lines.append(f"{self.name}{_labels(self.label_names, labels)} {_number(v)}")
        return "\n".join(lines)


class Histogram:
    """Observations counted into cumulative buckets, with their sum and count.

    Example:
        >>> h = Histogram("batch_size", "Rows per batch.", ("model",), buckets=(1, 4))
        >>> h.observe(3, "gpt")
        >>> print(h.render().splitlines()[3])
        batch_size_bucket{model="gpt",le="4"} 1
    """

    def __init__(self, name: str, help: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sums: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def observe(self, value: float, *labels: str) -> None:
        i = bisect.bisect_left(self.buckets, value)  # first bucket with value <= le
        with self._lock:
            counts = self._counts.setdefault(labels, [0] * (len(self.buckets) + 1))
            counts[i] += 1
            self._sums[labels] = self._sums.get(labels, 0.0) + value

    def count(self, *labels: str) -> int:
        with self._lock:
            return sum(self._counts.get(labels, ()))

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            for labels, counts in sorted(self._counts.items()):
                total = 0
                for le, n in zip([*map(_number, self.buckets), "+Inf"], counts):
                    total += n
                    bucket = _labels(self.label_names, labels, 'le="' + le + '"')
                    lines.append(f"{self.name}_bucket{bucket} {total}")
                lab = _labels(self.label_names, labels)
                lines.append(f"{self.name}_sum{lab} {_number(self._sums[labels])}")
                lines.append(f"{self.name}_count{lab} {total}")
        return "\n".join(lines)


class ServerMetrics:
    """Every metric the server keeps; ``render()`` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self.requests = Counter("gpufleet_inference_requests_total",
                                "Inference requests received.", ("model",))
        self.failures = Counter("gpufleet_inference_failures_total",
                                "Inference requests answered with an error.",
                                ("model", "reason"))
        self.latency = Histogram("gpufleet_inference_request_seconds",
                                 "Inference request latency, body read to response.",
                                 ("model",))
        self.queue = Histogram("gpufleet_inference_queue_seconds",
                               "Time a request waited in the batching queue.", ("model",))
        self.compute = Histogram("gpufleet_inference_compute_seconds",
                                 "Time the model took per executed batch.", ("model",))
        self.batch_size = Histogram("gpufleet_inference_batch_size",
                                    "Rows (samples) per executed batch.", ("model",),
                                    buckets=BATCH_BUCKETS)

    def render(self) -> str:
        metrics = (self.requests, self.failures, self.latency, self.queue, self.compute,
                   self.batch_size)
        return "\n".join(m.render() for m in metrics) + "\n"
