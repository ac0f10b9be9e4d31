"""Dynamic batching: concurrent requests are merged and each caller gets its own rows."""

import re
import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from gpufleet.serve.app import ServeOptions, create_app
from gpufleet.serve.batcher import DynamicBatcher, ModelError
from gpufleet.serve.export import outputs_of
from gpufleet.serve.metrics import ServerMetrics
from gpufleet.serve.runner import BackgroundServer

from .rawhttp import request


def _batch_sizes(metrics_text: str) -> tuple[int, float]:
    """(number of executed batches, total rows) of model gpt from /metrics."""
    count = re.search(r'gpufleet_inference_batch_size_count\{model="gpt"\} (\S+)', metrics_text)
    total = re.search(r'gpufleet_inference_batch_size_sum\{model="gpt"\} (\S+)', metrics_text)
    return int(float(count.group(1))), float(total.group(1))


def test_concurrent_clients_are_batched_and_get_their_own_rows(gpt_model):
    # A long queue delay makes merging certain even on a busy machine.
    app = create_app([gpt_model], ServeOptions(max_batch_size=8, max_queue_delay_us=200_000))
    rng = np.random.default_rng(7)
    # Two sequence lengths: requests of different shapes must not be merged together.
    xs = [rng.integers(0, 256, (1 + i % 2, 6 if i % 3 else 9), dtype=np.int64)
          for i in range(40)]
    with BackgroundServer(app) as server:
        client = httpclient.InferenceServerClient(server.address, concurrency=40)
        try:
            pending = []
            for x in xs:
                inp = httpclient.InferInput("INPUT__0", list(x.shape), "INT64")
                inp.set_data_from_numpy(x)
                pending.append(client.async_infer("gpt", [inp]))
            results = [p.get_result(timeout=60).as_numpy("OUTPUT__0") for p in pending]
        finally:
            client.close()
        text = request(server.url, "GET", "/metrics")[2].decode()
    for x, got in zip(xs, results):
        np.testing.assert_allclose(got, outputs_of(gpt_model, [x])[0], rtol=1e-4, atol=1e-5)
    batches, rows = _batch_sizes(text)
    assert rows == sum(len(x) for x in xs)
    assert batches < len(xs), "no two requests were merged"
    assert 'gpufleet_inference_batch_size_bucket{le="1.0",model="gpt"}' in text


def _double(xs):
    time.sleep(0.002)
    return [xs[0] * 2, xs[0].sum(axis=tuple(range(1, xs[0].ndim)))]


def test_batches_group_by_shape_and_respect_the_limit():
    calls = []

    def fn(xs):
        calls.append(xs[0].shape)
        return _double(xs)

    batcher = DynamicBatcher(fn, max_batch_size=4, max_queue_delay_s=0.05)
    try:
        inputs = [np.full((1, 2 + i % 2), i) for i in range(10)]
        futures = [batcher.submit([x]) for x in inputs]
        for x, f in zip(inputs, futures):
            doubled, total = f.result(timeout=10)
            np.testing.assert_array_equal(doubled, x * 2)
            np.testing.assert_array_equal(total, x.sum(axis=1))
    finally:
        batcher.close()
    assert all(shape[0] <= 4 for shape in calls)
    assert max(shape[0] for shape in calls) > 1
    assert sum(shape[0] for shape in calls) == 10


def test_a_bad_request_fails_alone():
    def fn(xs):
        if (xs[0] < 0).any():
            raise ValueError("negative input")
        return [xs[0] + 1]

    metrics = ServerMetrics()
    batcher = DynamicBatcher(fn, max_batch_size=8, max_queue_delay_s=0.05, metrics=metrics)
    try:
        futures = [batcher.submit([np.array([[v]])]) for v in (1, -1, 2)]
        assert futures[0].result(timeout=10)[0].tolist() == [[2]]
        with pytest.raises(ModelError, match="ValueError: negative input"):
            futures[1].result(timeout=10)
        assert futures[2].result(timeout=10)[0].tolist() == [[3]]
    finally:
        batcher.close()
    # The merged batch of 3 failed (not counted); the two good requests then ran alone.
    assert metrics.batch_size.count("model") == 2


def test_batching_off_runs_one_request_per_call():
    sizes, lock = [], threading.Lock()

    def fn(xs):
        with lock:
            sizes.append(len(xs[0]))
        return [xs[0]]

    batcher = DynamicBatcher(fn, max_batch_size=1, max_queue_delay_s=1.0)
    try:
        futures = [batcher.submit([np.zeros((1, 3))]) for _ in range(5)]
        for f in futures:
            f.result(timeout=10)
    finally:
        batcher.close()
    assert sizes == [1] * 5
