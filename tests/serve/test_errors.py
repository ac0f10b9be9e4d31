"""Mistakes a client can make get a 4xx with {"error": ...} naming the problem."""

import gzip
import json

import pytest

from .rawhttp import error_of, request

INFER = "/v2/models/gpt/infer"


def _req(inputs, **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _tok(shape=(1, 3), data=(1, 2, 3), datatype="INT64", name="INPUT__0"):
    return {"name": name, "datatype": datatype, "shape": list(shape), "data": list(data)}


CASES = [
    ("malformed JSON", INFER, b'{"inputs": [', {}, 400, "not valid JSON"),
    ("not an object", INFER, b"[1, 2]", {}, 400, "must be an object, got an array"),
    ("no inputs", INFER, b"{}", {}, 400, "inputs is missing"),
    ("empty inputs", INFER, b'{"inputs": []}', {}, 400, "inputs must be an array of at least"),
    ("wrong datatype", INFER, _req([_tok(datatype="FP32")]), {}, 400,
     "datatype FP32, but model 'gpt' takes INT64"),
    ("unknown datatype", INFER, _req([_tok(datatype="FP31")]), {}, 400,
     "Did you mean 'FP32'"),
    ("floats for INT64", INFER, _req([_tok(data=(1, 2.5, 3))]), {}, 400,
     "needs integers in 'data', got 2.5"),
    ("wrong rank", INFER, _req([_tok(shape=(3,))]), {}, 400,
     "shape [3] does not match [-1, -1]"),
    ("data count", INFER, _req([_tok(shape=(1, 4))]), {}, 400,
     "'data' has 3 elements, but its shape needs 4"),
    ("unknown input", INFER, _req([_tok(name="INPUT_0")]), {}, 400,
     "input: unknown value 'INPUT_0'. Did you mean 'INPUT__0'"),
    ("unknown output", INFER, _req([_tok()], outputs=[{"name": "logits"}]), {}, 400,
     "output: unknown value 'logits'"),
    ("unknown model", "/v2/models/gtp/infer", _req([_tok()]), {}, 404,
     "model: unknown value 'gtp'. Did you mean 'gpt'"),
    ("unknown version", "/v2/models/gpt/versions/3/infer", _req([_tok()]), {}, 404,
     "no version '3'"),
    ("header length past the body", INFER, _req([_tok()]),
     {"Inference-Header-Content-Length": "99999"}, 400, "Inference-Header-Content-Length"),
    ("binary size past the body", INFER,
     _req([{"name": "INPUT__0", "datatype": "INT64", "shape": [1, 2],
            "parameters": {"binary_data_size": 16}}]), {}, 400, "binary_data_size = 16"),
    ("token id out of range", INFER, _req([_tok(data=(1, 2, 999))]), {}, 400,
     "model 'gpt' failed on this request"),
    ("shared memory", INFER,
     _req([{"name": "INPUT__0", "datatype": "INT64", "shape": [1, 1],
            "parameters": {"shared_memory_region": "r"}}]), {}, 400, "shared-memory"),
    ("unknown encoding", INFER, _req([_tok()]), {"Content-Encoding": "br"}, 415,
     "Content-Encoding: unknown value 'br'"),
    ("unknown endpoint", "/v2/modelz", b"", {}, 404, "no endpoint"),
]
# Each field of the request with a value of the wrong JSON type: a 400 naming the field
# (an object or list where a string belongs used to reach the server's code: a 500).
WRONG_TYPES = [
    ("inputs[0].datatype must be a string, got an object", _req([_tok(datatype={})])),
    ("inputs[0].datatype must be a string, got an array", _req([_tok(datatype=["INT64"])])),
    ("inputs[0].name must be a string, got an integer", _req([_tok(name=7)])),
    ("inputs[0].shape must be an array, got a string", _req([{**_tok(), "shape": "1,3"}])),
    ("inputs[0].shape[1] must be an integer, got a number", _req([_tok(shape=(1, 3.0))])),
    ("inputs[0].data must be an array, got an object", _req([{**_tok(), "data": {"a": 1}}])),
    ("inputs[0].datatype is missing", _req([{"name": "INPUT__0", "shape": [1, 1],
                                             "data": [1]}])),
    ("inputs[0].parameters.binary_data_size must be a string, a number or a boolean, got "
     "an object", _req([{**_tok(), "parameters": {"binary_data_size": {}}}])),
    ("inputs[0].parameters must be an object, got an array",
     _req([{**_tok(), "parameters": [1]}])),
    ("inputs[1] must be an object, got a string", _req([_tok(), "INPUT__1"])),
    ("id must be a string, got an integer", _req([_tok()], id=5)),
    ("parameters must be an object, got a string", _req([_tok()], parameters="x")),
    ("parameters.binary_data_output must be a string, a number or a boolean, got an array",
     _req([_tok()], parameters={"binary_data_output": []})),
    ("outputs must be an array, got an object", _req([_tok()], outputs={"name": "x"})),
    ("outputs[0].name must be a string, got an object", _req([_tok()],
                                                              outputs=[{"name": {}}])),
    ("outputs[0].parameters.binary_data must be a string, a number or a boolean, got an "
     "object", _req([_tok()], outputs=[{"name": "OUTPUT__0",
                                        "parameters": {"binary_data": {"x": 1}}}])),
]
CASES += [(words.split(" ")[0], INFER, body, {}, 400, words) for words, body in WRONG_TYPES]


@pytest.mark.parametrize("what, path, body, headers, status, words", CASES,
                         ids=[c[0] for c in CASES])
def test_client_mistakes_are_4xx_naming_the_problem(server, what, path, body, headers,
                                                    status, words):
    method = "GET" if path == "/v2/modelz" else "POST"
    got, resp_headers, payload = request(server.url, method, path, body, headers)
    assert got == status, payload
    assert resp_headers["content-type"] == "application/json"
    assert words in error_of(payload)


def test_oversized_bodies_get_413_and_the_server_keeps_serving(server):
    big = _req([_tok(shape=(1, 100_000), data=[1] * 100_000)])  # > 256 KiB limit
    status, _, payload = request(server.url, "POST", INFER, big)
    assert status == 413 and "--max-body-bytes" in error_of(payload)
    bomb = gzip.compress(big)  # small on the wire, too big once inflated
    status, _, payload = request(server.url, "POST", INFER, bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "decompressed" in error_of(payload)
    status, _, payload = request(server.url, "POST", INFER, gzip.compress(_req([_tok()])),
                                 {"Content-Encoding": "gzip"})
    assert status == 200 and json.loads(payload)["outputs"][0]["shape"] == [1, 3, 256]


def test_failures_are_counted_in_the_metrics(server):
    request(server.url, "POST", INFER, b"{")
    status, headers, text = request(server.url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'gpufleet_inference_failures_total{model="gpt",reason="request"}' in text.decode()
