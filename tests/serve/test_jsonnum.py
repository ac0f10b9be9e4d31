"""JSON number arrays read straight into numpy: the same values json gives, json's own
parse for everything else, json's errors for malformed text."""

import json

import numpy as np
import pytest

from gpufleet.serve import jsonnum
from gpufleet.serve.protocol import ProtocolError, parse_infer_request


def _request(datatype: str, data: list, shape: list[int]) -> bytes:
    return json.dumps({"id": "[1, 2, 3]", "inputs": [
        {"name": "x", "datatype": datatype, "shape": shape, "data": data}]}).encode()


def test_a_large_float_array_is_numpy_with_the_values_json_reads():
    data = (np.random.default_rng(0).standard_normal(5000) * 1e3).tolist()
    text = json.dumps({"id": "[1,2]", "data": data, "shape": [1, 5000]})
    doc = jsonnum.loads(text)
    assert isinstance(doc["data"], jsonnum.Numbers) and not doc["data"].integral
    assert doc["data"].array.tolist() == json.loads(text)["data"]  # bit-exact
    assert doc["id"] == "[1,2]" and doc["shape"] == [1, 5000]  # short: plain json


def test_nested_integer_arrays_flatten_in_row_major_order():
    rows = [[i * 1000 + j for j in range(700)] for i in range(6)]
    doc = jsonnum.loads(json.dumps({"data": rows}))
    assert doc["data"].integral and doc["data"].array.dtype == np.int64
    assert doc["data"].array.tolist() == [v for row in rows for v in row]


@pytest.mark.parametrize("data", [
    [True, False] * 2000,  # not numbers
    [12345678901234567890] * 300,  # may not fit int64: json keeps it exact
    [[1, 2], "3"] * 2000,
])
def test_what_numpy_cannot_read_exactly_falls_back_to_json(data):
    text = json.dumps({"data": data})
    assert jsonnum.loads(text) == json.loads(text)


@pytest.mark.parametrize("text", [
    '{"data": [' + ",".join(["1"] * 3000) + ",]}",
    '{"data": [' + " ".join(["1"] * 3000) + "]}",
    '{"data": [[' + ",".join(["1"] * 3000) + "]}",
])
def test_malformed_arrays_fail_as_json_fails(text):
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        jsonnum.loads(text)


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "FP64", "BF16", "INT8", "INT64",
                                      "UINT16"])
def test_a_large_request_parses_to_the_arrays_the_stdlib_path_gives(datatype, monkeypatch):
    values = np.random.default_rng(1).integers(0, 120, 6000)
    data = values.tolist() if datatype[0] in "IU" else (values / 7).tolist()
    body = _request(datatype, data, [2, 3000])
    fast = parse_infer_request(body).inputs[0].array
    monkeypatch.setattr(jsonnum, "MIN_FAST_CHARS", 10**12)  # every array through json
    slow = parse_infer_request(body).inputs[0].array
    assert fast.dtype == slow.dtype and fast.shape == slow.shape == (2, 3000)
    assert fast.tobytes() == slow.tobytes()


@pytest.mark.parametrize("datatype, data, words", [
    ("INT8", [1000] * 3000, "out of range for INT8"),
    ("INT32", [1.5] * 3000, "needs integers"),
    ("BOOL", [1] * 3000, "needs true/false"),
    ("BYTES", [1] * 3000, "needs strings"),
    ("FP32", [1.0] * 2999, "'data' has 2999 elements, but its shape needs 3000"),
])
def test_large_arrays_get_the_same_checks(datatype, data, words):
    with pytest.raises(ProtocolError, match=words):
        parse_infer_request(_request(datatype, data, [1, 3000]))
