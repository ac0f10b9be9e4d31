"""HTTP to the letter: trailing slashes, Allow on 405, strict JSON with non-finite floats."""

import json
import math

import numpy as np
import pytest
import tritonclient.http as httpclient

from gpufleet.serve.app import create_app
from gpufleet.serve.model import ServedModel, TensorSpec, from_module
from gpufleet.serve.runner import BackgroundServer

from .rawhttp import error_of, request


def strict_loads(body: bytes):
    """JSON as RFC 8259 defines it: NaN, Infinity and -Infinity are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(body, parse_constant=refuse)


@pytest.mark.parametrize("path", ["/v2/", "/v2/health/live/", "/v2/health/ready/",
                                  "/v2/models/gpt/", "/v2/models/gpt/versions/1/",
                                  "/v2/models/gpt/ready/", "/v2/models/gpt/config/"])
def test_a_trailing_slash_answers_like_the_path_without_it(server, path):
    status, headers, body = request(server.url, "GET", path)
    want = request(server.url, "GET", path.rstrip("/"))
    assert (status, body) == (want[0], want[2]) and status == 200, (status, headers)
    assert "location" not in headers


def test_inference_on_the_slashed_path(server):
    body = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "INT64", "shape": [1, 2],
                                   "data": [5, 6]}]}).encode()
    status, _, content = request(server.url, "POST", "/v2/models/gpt/infer/", body)
    assert status == 200 and strict_loads(content)["outputs"][0]["shape"] == [1, 2, 256]


@pytest.mark.parametrize("method, path, allowed", [
    ("POST", "/v2", {"GET", "HEAD"}), ("DELETE", "/v2/health/live", {"GET", "HEAD"}),
    ("GET", "/v2/models/gpt/infer", {"POST"}), ("PUT", "/v2/models/gpt/infer/", {"POST"}),
    ("GET", "/v2/repository/index", {"POST"}), ("POST", "/metrics", {"GET", "HEAD"})])
def test_405_names_the_allowed_methods(server, method, path, allowed):
    status, headers, body = request(server.url, method, path)
    assert status == 405
    assert {m.strip() for m in headers["allow"].split(",")} == allowed
    assert method in error_of(body)


@pytest.fixture(scope="module")
def nonfinite_server():
    import torch

    class Special(torch.nn.Module):
        def forward(self, x):
            y = x.clone()
            y[:, 0], y[:, 1], y[:, 2] = math.nan, math.inf, -math.inf
            return y.half(), y, y.double(), y.bfloat16()

    model = from_module("special", Special(), [TensorSpec("x", "FP32", (4,))], "cpu")
    with BackgroundServer(create_app([model])) as srv:
        yield srv


def test_non_finite_floats_travel_as_strings_in_strict_json(nonfinite_server):
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                   "data": [1, 2, 3, 4.5]}]}).encode()
    status, _, content = request(nonfinite_server.url, "POST", "/v2/models/special/infer",
                                 body)
    assert status == 200, content
    outputs = strict_loads(content)["outputs"]
    assert [o["datatype"] for o in outputs] == ["FP16", "FP32", "FP64", "BF16"]
    for o in outputs:
        assert o["data"] == ["NaN", "Infinity", "-Infinity", 4.5]


def test_tritonclient_reads_non_finite_json_outputs_back(nonfinite_server):
    client = httpclient.InferenceServerClient(nonfinite_server.address)
    try:
        x = np.array([[1, 2, 3, 4.5]], np.float32)
        inp = httpclient.InferInput("x", [1, 4], "FP32").set_data_from_numpy(
            x, binary_data=False)
        outs = [httpclient.InferRequestedOutput(f"OUTPUT__{i}", binary_data=False)
                for i in range(3)]  # tritonclient has no JSON BF16
        result = client.infer("special", [inp], outputs=outs)
        for i, dtype in enumerate([np.float16, np.float32, np.float64]):
            got = result.as_numpy(f"OUTPUT__{i}")
            assert got.dtype == dtype
            np.testing.assert_array_equal(got, [[np.nan, np.inf, -np.inf, 4.5]])
    finally:
        client.close()


def test_non_finite_strings_are_accepted_in_float_inputs(nonfinite_server):
    """What the server sends can be sent back (and tritonclient's bare NaN still parses)."""
    for data in (["NaN", "Infinity", "-Infinity", 1.5], b"[NaN, Infinity, -Infinity, 1.5]"):
        text = json.dumps(data).encode() if isinstance(data, list) else data
        body = (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": '
                + text + b'}], "outputs": [{"name": "OUTPUT__1", "parameters": '
                b'{"binary_data": false}}]}')
        status, _, content = request(nonfinite_server.url, "POST",
                                     "/v2/models/special/infer", body)
        assert status == 200, content
        assert strict_loads(content)["outputs"][0]["data"][3] == 1.5
    bad = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                  "data": ["nan", 1, 2, 3]}]}).encode()
    status, _, content = request(nonfinite_server.url, "POST", "/v2/models/special/infer",
                                 bad)
    assert status == 400 and '"NaN", "Infinity", "-Infinity"' in error_of(content)


def test_an_unexpected_server_error_is_a_json_500():
    """A bug (here: a model whose metadata JSON cannot encode) still answers JSON."""
    model = ServedModel("odd", [TensorSpec("x", "FP32", (1,))],
                        [TensorSpec("y", "FP32", (1,))], lambda xs: xs, platform=object())
    with BackgroundServer(create_app([model])) as srv:
        status, headers, body = request(srv.url, "GET", "/v2/models/odd")
        assert status == 500 and headers["content-type"] == "application/json"
        assert "bug in gpufleet serve" in error_of(body)
        assert request(srv.url, "GET", "/v2/health/live")[0] == 200
