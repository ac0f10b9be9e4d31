"""/metrics speaks the Prometheus exposition format (read back with prometheus_client)."""

from prometheus_client.parser import text_string_to_metric_families

from gpufleet.serve.metrics import ServerMetrics


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_counts_and_histograms_read_back_through_prometheus_parser():
    m = ServerMetrics()
    m.requests.inc("gpt")
    m.requests.inc("gpt")
    m.failures.inc("gpt", "model")
    m.batch_size.observe(3, "gpt")
    m.batch_size.observe(8, "gpt")
    m.latency.observe(0.002, 'odd"name\n')  # label values are escaped
    got = _samples(m.render())
    assert got[("gpufleet_inference_requests_total", (("model", "gpt"),))] == 2
    assert got[("gpufleet_inference_failures_total",
                (("model", "gpt"), ("reason", "model")))] == 1
    assert got[("gpufleet_inference_batch_size_bucket", (("le", "4.0"), ("model", "gpt")))] == 1
    assert got[("gpufleet_inference_batch_size_bucket", (("le", "8.0"), ("model", "gpt")))] == 2
    assert got[("gpufleet_inference_batch_size_sum", (("model", "gpt"),))] == 11
    assert got[("gpufleet_inference_request_seconds_count", (("model", 'odd"name\n'),))] == 1
    assert m.requests.value("gpt") == 2 and m.batch_size.count("gpt") == 2


def test_two_servers_keep_their_own_counts():
    a, b = ServerMetrics(), ServerMetrics()
    a.requests.inc("gpt")
    assert a.requests.value("gpt") == 1 and b.requests.value("gpt") == 0
