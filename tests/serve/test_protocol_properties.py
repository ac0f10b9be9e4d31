"""Properties over requests generated from the protocol's schemas (Open Inference
Protocol / KServe v2 REST, and Triton's model repository extension).

The schemas below are this test's own encoding of the specification's rules, written
as JSON Schema. Requests are drawn from them, each field of each request either valid
or replaced by a value of another JSON type (or dropped), so both the answers to valid
requests and to broken ones are covered. Whatever the request:

- the server never answers 5xx;
- every JSON body is strict RFC 8259 JSON (no bare NaN or Infinity);
- an error body matches the protocol's error schema, a success body its response schema;
- a 405 carries an Allow header.

Bounded for the default run: a fixed number of examples, derandomized (the same
examples every run), a per-example deadline.
"""

import json
import math
import struct

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from gpufleet.serve.app import ServeOptions, create_app
from gpufleet.serve.export import export_triton
from gpufleet.serve.model import TensorSpec, from_module
from gpufleet.serve.repository import ModelRepository
from gpufleet.serve.runner import BackgroundServer

from .rawhttp import request

MODELS = ["float", "ints", "text", "nope"]
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
             "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16"]

# -- the protocol's schemas, as data -------------------------------------------------------
# "examples" only steer the generator towards names the served models know.
PARAMETERS = {"type": "object", "additionalProperties": {
    "type": ["string", "number", "boolean"]}}
TENSOR_DATA = {"type": "array"}  # flat or nested; element types depend on the datatype
REQUEST_INPUT = {
    "type": "object", "required": ["name", "shape", "datatype"],
    "properties": {"name": {"type": "string", "examples": ["x", "t", "TEXT"]},
                   "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                   "datatype": {"type": "string", "enum": DATATYPES},
                   "parameters": PARAMETERS, "data": TENSOR_DATA}}
REQUEST_OUTPUT = {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string", "examples": ["OUTPUT__0", "OUTPUT__1"]},
                   "parameters": PARAMETERS}}
INFER_REQUEST = {
    "type": "object", "required": ["inputs"],
    "properties": {"id": {"type": "string"}, "parameters": PARAMETERS,
                   "inputs": {"type": "array", "minItems": 1, "items": REQUEST_INPUT},
                   "outputs": {"type": "array", "items": REQUEST_OUTPUT}}}
REPOSITORY_INDEX_REQUEST = {"type": "object", "properties": {"ready": {"type": "boolean"}}}
LOAD_REQUEST = {"type": "object", "properties": {"parameters": PARAMETERS}}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
METADATA_TENSOR = {"type": "object", "required": ["name", "datatype", "shape"],
                   "properties": {"name": {"type": "string"},
                                  "datatype": {"type": "string", "enum": DATATYPES},
                                  "shape": {"type": "array", "items": {"type": "integer"}}}}
SERVER_METADATA = {"type": "object", "required": ["name", "version", "extensions"],
                   "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                  "extensions": {"type": "array",
                                                 "items": {"type": "string"}}}}
MODEL_METADATA = {"type": "object", "required": ["name", "platform", "inputs", "outputs"],
                  "properties": {"name": {"type": "string"},
                                 "versions": {"type": "array", "items": {"type": "string"}},
                                 "platform": {"type": "string"},
                                 "inputs": {"type": "array", "items": METADATA_TENSOR},
                                 "outputs": {"type": "array", "items": METADATA_TENSOR}}}
RESPONSE_OUTPUT = {
    "type": "object", "required": ["name", "shape", "datatype"],
    "properties": {"name": {"type": "string"},
                   "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                   "datatype": {"type": "string", "enum": DATATYPES},
                   "parameters": PARAMETERS, "data": TENSOR_DATA}}
INFER_RESPONSE = {
    "type": "object", "required": ["model_name", "outputs"],
    "properties": {"model_name": {"type": "string"}, "model_version": {"type": "string"},
                   "id": {"type": "string"}, "parameters": PARAMETERS,
                   "outputs": {"type": "array", "items": RESPONSE_OUTPUT}}}
REPOSITORY_INDEX = {"type": "array", "items": {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                   "state": {"type": "string"}, "reason": {"type": "string"}}}}

# -- requests drawn from a schema ------------------------------------------------------------
SCALARS = {"string": st.text(max_size=6), "integer": st.integers(-3, 2**40),
           "number": st.floats(allow_nan=False, allow_infinity=False, width=32),
           "boolean": st.booleans(), "null": st.none()}
ANY_JSON = st.recursive(st.one_of(*SCALARS.values()),
                        lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                        max_leaves=6)
OF_TYPE = {**SCALARS, "array": st.lists(ANY_JSON, max_size=3),
           "object": st.dictionaries(st.text(max_size=4), ANY_JSON, max_size=3)}


@st.composite
def instance(draw, schema, break_rate):
    """A value of ``schema``; each node, with probability ``break_rate``, one of another
    JSON type instead."""
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if break_rate and draw(st.floats(0, 1)) < break_rate:
        others = [t for t in OF_TYPE if t not in types
                  and not (t == "integer" and "number" in types)]
        return draw(OF_TYPE[draw(st.sampled_from(others))])
    kind = draw(st.sampled_from(types))
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    if kind == "object":
        out = {}
        for key, sub in schema.get("properties", {}).items():
            required = key in schema.get("required", ())
            if required and not (break_rate and draw(st.floats(0, 1)) < break_rate / 2):
                out[key] = draw(instance(sub, break_rate))
            elif not required and draw(st.booleans()):
                out[key] = draw(instance(sub, break_rate))
        if "additionalProperties" in schema:
            extra = draw(st.dictionaries(st.sampled_from(
                ["binary_data", "binary_data_size", "binary_data_output", "priority", "k"]),
                instance(schema["additionalProperties"], break_rate), max_size=2))
            out.update(extra)
        return out
    if kind == "array":
        items = schema.get("items")
        if items is None:
            return draw(st.lists(ANY_JSON, max_size=4))
        return draw(st.lists(instance(items, break_rate), min_size=schema.get("minItems", 0),
                             max_size=3))
    if kind == "string" and "examples" in schema:
        return draw(st.sampled_from(schema["examples"]) | SCALARS["string"])
    if kind == "integer":
        return draw(st.integers(schema.get("minimum", -3), 6))
    return draw(SCALARS[kind])


def _values(datatype, n):
    """``n`` values that fit ``datatype`` in JSON."""
    if datatype == "BOOL":
        return st.lists(st.booleans(), min_size=n, max_size=n)
    if datatype == "BYTES":
        return st.lists(st.text(max_size=4), min_size=n, max_size=n)
    if datatype.startswith(("INT", "UINT")):
        return st.lists(st.integers(0, 100), min_size=n, max_size=n)
    return st.lists(st.floats(-4, 4, width=16) | st.sampled_from(["NaN", "Infinity"]),
                    min_size=n, max_size=n)


SIGNATURES = {"float": ("x", "FP32"), "ints": ("t", "INT64"), "text": ("TEXT", "BYTES"),
              "nope": ("x", "FP32")}


@st.composite
def infer_bodies(draw, model, kind=None):
    """An inference request from the schema, in one of three kinds: one that fits
    ``model`` (its first input gets the model's name and datatype and data that fits the
    shape, maybe as binary data), one valid by the schema only, or one with fields of
    the wrong type or missing."""
    kind = kind or draw(st.sampled_from(["fits", "schema", "broken"]))
    doc = draw(instance(INFER_REQUEST, draw(st.sampled_from([0.05, 0.15]))
                        if kind == "broken" else 0.0))
    binary = b""
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    if kind == "fits":
        tensor = inputs[0]
        del inputs[1:]
        doc.pop("outputs", None)
        doc.pop("parameters", None)
        if draw(st.booleans()):  # the output asked for, in JSON or as binary data
            doc["outputs"] = [{"name": "OUTPUT__0",
                               "parameters": {"binary_data": draw(st.booleans())}}]
        elif draw(st.booleans()):
            doc["parameters"] = {"binary_data_output": draw(st.booleans())}
        tensor["name"], tensor["datatype"] = SIGNATURES[model]
        n = draw(st.integers(1, 4))
        tensor["shape"] = [draw(st.integers(1, 2)), n]
        values = draw(_values(tensor["datatype"], n * tensor["shape"][0]))
        if tensor["datatype"] != "BYTES" and draw(st.booleans()):
            dtype = np.int64 if tensor["datatype"] == "INT64" else np.float32
            raw = np.array(values, dtype=dtype).tobytes()
            tensor.pop("data", None)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            binary += raw
        else:
            tensor.pop("parameters", None)
            tensor["data"] = values
    head = json.dumps(doc).encode()
    headers = {"Inference-Header-Content-Length": str(len(head))} if binary else {}
    return head + binary, headers


@st.composite
def infer_cases(draw, models=MODELS, kind=None):
    model = draw(st.sampled_from(models))
    return model, draw(infer_bodies(model, kind))


# -- the served models -------------------------------------------------------------------------
def _float_model(x):
    with np.errstate(all="ignore"):  # log of 0 and of negatives: non-finite outputs
        return x * 2, np.log(x)


def _text_model(text):
    out = np.empty(text.shape, dtype=object)
    out.reshape(-1)[:] = [s.upper() for s in text.reshape(-1)]
    return out


@pytest.fixture(scope="module")
def fixed_server():
    models = [from_module("float", _float_model, [TensorSpec("x", "FP32", (-1,))], "cpu"),
              from_module("ints", lambda t: t + 1, [TensorSpec("t", "INT64", (-1,))], "cpu"),
              from_module("text", _text_model, [TensorSpec("TEXT", "BYTES", (-1,))], "cpu")]
    app = create_app(models, ServeOptions(max_batch_size=4, max_queue_delay_us=0))
    with BackgroundServer(app) as srv:
        yield srv


class _Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


@pytest.fixture(scope="module")
def repository_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    export_triton(from_module("double", _Double(), [TensorSpec("x", "FP32", (2,))], "cpu"),
                  root)
    repository = ModelRepository(root, device="cpu")
    models, unavailable = repository.load_all()
    with BackgroundServer(create_app(models, None, repository, unavailable)) as srv:
        yield srv


# -- what every answer must satisfy ----------------------------------------------------------
def strict_loads(body: bytes):
    def refuse(name):
        raise ValueError(f"{name} is not JSON (RFC 8259)")

    return json.loads(body, parse_constant=refuse)


def check_answer(status, headers, content, success_schema=None):
    event(f"status {status}")
    assert status < 500, content
    assert not 300 <= status < 400, f"a redirect ({status}) where the protocol has a path"
    if status == 405:
        assert headers.get("allow"), "a 405 without an Allow header"
    kind = headers.get("content-type", "")
    if status >= 400:
        assert kind == "application/json", (status, headers)
        jsonschema.validate(strict_loads(content), ERROR)
        return None
    if kind == "application/octet-stream":  # JSON header, then binary tensor data
        n = int(headers["inference-header-content-length"])
        doc = strict_loads(content[:n])
    elif content:
        doc = strict_loads(content)
    else:
        return None
    if success_schema is not None:
        jsonschema.validate(doc, success_schema)
    return doc


# No explain phase: it reruns a failure many times over, for a report the shrunk
# example already gives.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]
PROPERTY = settings(max_examples=60, deadline=5000, derandomize=True, phases=PHASES,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


@PROPERTY
@given(case=infer_cases(models=["float", "ints", "text"]),  # unknown ones: the next test
       version=st.sampled_from(["", "/versions/1"]),
       slash=st.sampled_from(["", "/"]))
def test_inference_answers_fit_the_protocol(fixed_server, case, version, slash):
    model, (payload, headers) = case
    status, got_headers, content = request(
        fixed_server.url, "POST", f"/v2/models/{model}{version}/infer{slash}", payload,
        headers)
    doc = check_answer(status, got_headers, content, INFER_RESPONSE)
    if status == 200:
        for out in doc["outputs"]:
            if "data" in out:
                assert len(out["data"]) == math.prod(out["shape"])
                if out["datatype"].startswith("FP"):
                    assert all(isinstance(v, (int, float)) or v in (
                        "NaN", "Infinity", "-Infinity") for v in out["data"])


@settings(PROPERTY, max_examples=40)
@given(case=infer_cases(models=["float", "ints", "text"], kind="fits"))
def test_requests_that_fit_the_model_succeed(fixed_server, case):
    model, (payload, headers) = case
    status, got_headers, content = request(fixed_server.url, "POST",
                                           f"/v2/models/{model}/infer", payload, headers)
    assert status == 200, content
    doc = check_answer(status, got_headers, content, INFER_RESPONSE)
    sent = json.loads(payload[:int(headers.get("Inference-Header-Content-Length",
                                               len(payload)))])["inputs"][0]
    assert doc["model_name"] == model
    assert doc["outputs"][0]["shape"] == sent["shape"]
    if model == "ints" and "data" in sent and "data" in doc["outputs"][0]:
        assert doc["outputs"][0]["data"] == [v + 1 for v in sent["data"]]


PATHS = {"/v2": "GET", "/v2/health/live": "GET", "/v2/health/ready": "GET",
         "/v2/models/{m}": "GET", "/v2/models/{m}/versions/1": "GET",
         "/v2/models/{m}/ready": "GET", "/v2/models/{m}/config": "GET",
         "/v2/models/{m}/versions/2/ready": "GET", "/v2/models/{m}/infer": "POST",
         "/metrics": "GET", "/v2/repository/index": "POST",
         "/v2/repository/models/{m}/load": "POST", "/v2/repository/models/{m}/unload": "POST",
         "/v2/model": "GET", "/": "GET"}
METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"]


@PROPERTY
@given(path=st.sampled_from(sorted(PATHS)), other=st.none() | st.sampled_from(METHODS),
       model=st.sampled_from(MODELS), slash=st.sampled_from(["", "/"]),
       body=ANY_JSON.map(lambda v: json.dumps(v).encode()))
def test_every_endpoint_answers_within_the_protocol(fixed_server, path, other, model,
                                                    slash, body):
    method = other or PATHS[path]  # mostly the path's own method, else any
    path = path.format(m=model) + slash
    status, headers, content = request(fixed_server.url, method, path, body)
    if method == "HEAD":  # no body, whatever the status
        assert status < 300 or 400 <= status < 500
        assert status != 405 or headers.get("allow")
        return
    schema = None
    if method == "GET" and path.rstrip("/") == "/v2":
        schema = SERVER_METADATA
    elif method == "GET" and path.rstrip("/") in (f"/v2/models/{model}",
                                                   f"/v2/models/{model}/versions/1"):
        schema = MODEL_METADATA
    if path.rstrip("/") == "/metrics" and status == 200:
        return  # Prometheus text
    check_answer(status, headers, content, schema)


@settings(max_examples=25, deadline=10_000, derandomize=True, phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(action=st.sampled_from(["index", "load", "unload"]),
       model=st.sampled_from(["double", "dubble"]),
       doc=st.one_of(instance(LOAD_REQUEST, 0.3), instance(REPOSITORY_INDEX_REQUEST, 0.3),
                     ANY_JSON),
       raw=st.sampled_from([None, b"", b"{", struct.pack("<d", math.nan)]))
def test_repository_requests_answer_within_the_protocol(repository_server, action, model,
                                                        doc, raw):
    body = json.dumps(doc).encode() if raw is None else raw
    path = ("/v2/repository/index" if action == "index"
            else f"/v2/repository/models/{model}/{action}")
    status, headers, content = request(repository_server.url, "POST", path, body)
    check_answer(status, headers, content, REPOSITORY_INDEX if action == "index" else None)


def test_the_model_can_be_loaded_after_the_repository_properties(repository_server):
    assert request(repository_server.url, "POST",
                   "/v2/repository/models/double/load")[0] == 200
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                                   "data": [1.5, -2]}]}).encode()
    status, _, content = request(repository_server.url, "POST",
                                 "/v2/models/double/infer", body)
    assert status == 200 and strict_loads(content)["outputs"][0]["data"] == [3.0, -4.0]
