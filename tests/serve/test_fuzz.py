"""Property: no request, however malformed, gets a 5xx or stops the server."""

import json
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .rawhttp import request

PATHS = ["/v2/models/gpt/infer", "/v2/models/upper/infer", "/v2/models/echo/infer",
         "/v2/models/gpt/versions/1/infer", "/v2/models/nope/infer"]
DATATYPES = ["INT64", "FP32", "BYTES", "BOOL", "UINT8", "FP16", "BF16", "INT8", "FP64",
             "STRING", ""]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.integers(-2, 6), max_size=4))
    tensor = {"name": draw(st.sampled_from(["INPUT__0", "TEXT", "IN_FP32", "x", ""])),
              "datatype": draw(st.sampled_from(DATATYPES)), "shape": shape}
    binary = b""
    if draw(st.booleans()):
        binary = draw(st.binary(max_size=96))
        size = draw(st.sampled_from([len(binary), len(binary) + 1, 0, -1]))
        tensor["parameters"] = {"binary_data_size": size}
    else:
        tensor["data"] = draw(st.lists(st.integers(-5, 300) | st.floats(allow_nan=False)
                                       | st.text(max_size=3) | st.booleans(), max_size=40))
    if draw(st.booleans()):
        tensor = {k: v for k, v in tensor.items() if draw(st.booleans())}  # drop fields
    return tensor, binary


@st.composite
def infer_bodies(draw):
    """Requests shaped like v2 inference requests, with every field open to mistakes."""
    parts = draw(st.lists(tensors(), min_size=0, max_size=3))
    doc = {"inputs": [t for t, _ in parts]}
    if draw(st.booleans()):
        doc["outputs"] = [{"name": draw(st.sampled_from(["OUTPUT__0", "OUTPUT__3", "y"])),
                           "parameters": {"binary_data": draw(json_values)}}]
    if draw(st.booleans()):
        doc["parameters"] = {"binary_data_output": draw(json_values)}
    head = json.dumps(doc).encode()
    binary = b"".join(b for _, b in parts)
    headers = {}
    if binary or draw(st.booleans()):
        headers["Inference-Header-Content-Length"] = draw(st.sampled_from(
            [str(len(head)), str(len(head) + 3), "-1", "x", str(len(head) - 1)]))
    return head + binary, headers


_BYTES_HEAD = (b'{"inputs":[{"name":"TEXT","datatype":"BYTES","shape":[1,1],'
               b'"parameters":{"binary_data_size":8}}]}')
bodies = st.one_of(
    infer_bodies(),
    json_values.map(lambda v: (json.dumps(v).encode(), {})),
    st.binary(max_size=200).map(lambda b: (b, {})),
    st.binary(max_size=64).map(lambda b: (b, {"Inference-Header-Content-Length":
                                              str(len(b) // 2)})),
    st.integers(0, 2**32 - 1).map(lambda n: (  # BYTES elements with any length prefix
        _BYTES_HEAD + struct.pack("<I", n) + b"abcd",
        {"Inference-Header-Content-Length": str(len(_BYTES_HEAD))})),
)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), body=bodies)
def test_malformed_requests_never_get_a_5xx(server, path, body):
    payload, headers = body
    status, _, content = request(server.url, "POST", path, payload, headers)
    assert status < 500, content
    if status >= 400:
        assert "error" in json.loads(content)


def test_the_server_still_answers_after_the_fuzzing(server):
    assert request(server.url, "GET", "/v2/health/live")[0] == 200
    body = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "INT64", "shape": [1, 2],
                                   "data": [5, 6]}]}).encode()
    status, _, content = request(server.url, "POST", "/v2/models/gpt/infer", body)
    assert status == 200, content
