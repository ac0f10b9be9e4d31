"""The KServe v2 / Triton inference protocol over HTTP: requests, responses, datatypes.

An inference request is JSON, optionally followed by raw tensor bytes (the *binary tensor
data extension*): the ``Inference-Header-Content-Length`` header gives the length of the
JSON part, each input with ``parameters.binary_data_size`` takes its bytes from what
follows, in input order. Numeric tensors are little-endian, row-major; a ``BYTES``
element is a 4-byte little-endian length followed by that many bytes. Outputs are sent
the same way when the request asks for ``binary_data`` (per output) or
``binary_data_output`` (for all).

Everything a client can get wrong raises :class:`ProtocolError` with the HTTP status to
answer and a message that names the problem.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufleet.errors import GpufleetError, unknown_choice
from gpufleet.serve import jsonnum
from gpufleet.serve.schema import INFER_REQUEST, Schema, problem

try:  # bfloat16 for numpy; shipped with tritonclient, optional here
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover - only without ml_dtypes
    _bfloat16 = None

HEADER_LENGTH = "Inference-Header-Content-Length"

# v2 datatype name -> numpy dtype (little-endian). BYTES elements are Python bytes.
DTYPES: dict[str, Any] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"), "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(np.object_),
}
if _bfloat16 is not None:
    DTYPES["BF16"] = np.dtype(_bfloat16)

_INTS = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
_FLOATS = {"FP16", "FP32", "FP64", "BF16"}
# Non-finite floats in JSON tensor data, both ways (the names of protobuf's JSON mapping).
NON_FINITE_TEXT = {math.inf: "Infinity", -math.inf: "-Infinity"}
NON_FINITE_VALUES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


class ProtocolError(GpufleetError, ValueError):
    """A request the server cannot accept; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple:  # keeps the status across processes (the parse pool)
        return type(self), (str(self), self.status)


# Shapes: numpy allows 64 dims, no served model takes more than a handful; elements are
# capped so that a shape cannot ask for more memory than any body could fill.
MAX_DIMS = 32
MAX_ELEMENTS = 2**31


@dataclass
class Tensor:
    """One named tensor of a request or response (``array.shape`` is its shape)."""

    name: str
    datatype: str
    array: np.ndarray


@dataclass
class OutputRequest:
    """An output the client asked for, and whether it wants it as binary data."""

    name: str
    binary: bool | None = None  # None: follow the request's binary_data_output


@dataclass
class InferRequest:
    """A parsed inference request."""

    id: str | None
    inputs: list[Tensor]
    outputs: list[OutputRequest] | None  # None: every output of the model
    binary_output: bool = False  # the request's binary_data_output parameter


def datatype_of(dtype: np.dtype) -> str:
    """The v2 datatype name of a numpy dtype.

    Example:
        >>> datatype_of(np.dtype("float32"))
        'FP32'
    """
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return "BYTES"
    for name, known in DTYPES.items():
        if known == dtype.newbyteorder("<") or known == dtype:
            return name
    raise ProtocolError(f"numpy dtype {dtype} has no v2 datatype. Use one of "
                        f"{', '.join(DTYPES)}.", status=500)


def parse_infer_request(body: bytes | bytearray,
                        header_length: str | None = None) -> InferRequest:
    """Parse an inference request body (JSON, or JSON + binary tensor data).

    Args:
        body: the whole HTTP body.
        header_length: the ``Inference-Header-Content-Length`` header, if any.

    Example:
        >>> req = parse_infer_request(b'{"inputs": [{"name": "x", "datatype": "INT32", '
        ...                           b'"shape": [1, 2], "data": [1, 2]}]}')
        >>> req.inputs[0].array.tolist()
        [[1, 2]]
    """
    json_part, binary = _split_body(body, header_length)
    try:
        doc = jsonnum.loads(json_part)  # large number arrays straight into numpy
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError(f"the request body is not valid JSON: {e}. Send a JSON object "
                            "with an 'inputs' list (KServe v2 protocol).") from None
    require(doc, INFER_REQUEST, "the inference request")  # every field's type, before use
    params = _dict_field(doc, "parameters", "the request")
    request_id = doc.get("id")
    raw_inputs = doc["inputs"]
    inputs, used = [], 0
    for i, raw in enumerate(raw_inputs):
        tensor, used = _parse_input(raw, i, binary, used)
        inputs.append(tensor)
    if used != len(binary):
        raise ProtocolError(f"the body has {len(binary) - used} bytes of binary data that no "
                            "input claims. Check each input's binary_data_size and the "
                            f"{HEADER_LENGTH} header.")
    outputs = None
    if doc.get("outputs") is not None:
        outputs = [_parse_output(raw, i) for i, raw in enumerate(doc["outputs"])]
    binary_output = params.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise ProtocolError(f"parameters.binary_data_output must be true or false, "
                            f"got {binary_output!r}.")
    return InferRequest(request_id, inputs, outputs, binary_output)


def require(doc: Any, schema: Schema, where: str) -> None:
    """Raise a 400 :class:`ProtocolError` naming the first field of ``doc`` that does not
    fit ``schema`` (see :mod:`gpufleet.serve.schema`)."""
    message = problem(doc, schema, where)
    if message is not None:
        raise ProtocolError(message)


def _split_body(body: bytes | bytearray,
                header_length: str | None) -> tuple[memoryview, bytes]:
    view = memoryview(body)  # the JSON part is read in place, not copied
    if header_length is None:
        return view, b""
    try:
        n = int(header_length)
    except ValueError:
        n = -1
    if not 0 <= n <= len(body):
        raise ProtocolError(f"{HEADER_LENGTH} = {header_length!r} is not a length within the "
                            f"{len(body)}-byte body. Give the byte length of the JSON part.")
    return view[:n], bytes(view[n:])


def _dict_field(doc: dict, key: str, where: str) -> dict:
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"'{key}' of {where} must be an object, got {value!r}.")
    return value


def _parse_input(raw: Any, i: int, binary: bytes, used: int) -> tuple[Tensor, int]:
    if not isinstance(raw, dict):
        raise ProtocolError(f"inputs[{i}] must be an object, got {type(raw).__name__}.")
    name = raw.get("name")
    if not isinstance(name, str):
        raise ProtocolError(f"inputs[{i}] has no string 'name'.")
    where = f"input {name!r}"
    datatype = raw.get("datatype")
    if datatype not in DTYPES:
        raise ProtocolError(unknown_choice(f"{where}: datatype", datatype, DTYPES))
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(
            type(d) is int and 0 <= d < 2**40 for d in shape):
        raise ProtocolError(f"{where}: 'shape' must be a list of non-negative integers, "
                            f"got {shape!r}.")
    if len(shape) > MAX_DIMS:
        raise ProtocolError(f"{where}: shape has {len(shape)} dims; this server takes at "
                            f"most {MAX_DIMS}. Send the shape the model takes (see "
                            "GET /v2/models/NAME).")
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise ProtocolError(f"{where}: shape {shape} has more than {MAX_ELEMENTS:,} elements. "
                            "Send smaller batches.")
    params = _dict_field(raw, "parameters", where)
    for key in _SHARED_MEMORY:
        if key in params:
            raise ProtocolError(f"{where}: {key}: this server has no shared-memory support. "
                                "Send the data in the body (JSON or binary).")
    count = math.prod(shape)
    size = params.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0 or used + size > len(binary):
            raise ProtocolError(f"{where}: binary_data_size = {size!r} does not fit the "
                                f"{len(binary) - used} binary bytes left in the body.")
        chunk = binary[used:used + size]
        array = _from_binary(chunk, datatype, count, where)
        return Tensor(name, datatype, array.reshape(shape)), used + size
    if "data" not in raw:
        raise ProtocolError(f"{where} has neither 'data' nor parameters.binary_data_size.")
    array = _from_json(raw["data"], datatype, count, where)
    return Tensor(name, datatype, array.reshape(shape)), used


def _from_binary(chunk: bytes, datatype: str, count: int, where: str) -> np.ndarray:
    if datatype == "BYTES":
        return _deserialize_bytes(chunk, count, where)
    dtype = DTYPES[datatype]
    if len(chunk) != count * dtype.itemsize:
        raise ProtocolError(f"{where}: {len(chunk)} bytes of binary data, but its shape and "
                            f"datatype {datatype} need {count * dtype.itemsize}.")
    return np.frombuffer(chunk, dtype=dtype)


def _deserialize_bytes(chunk: bytes, count: int, where: str) -> np.ndarray:
    items, pos = [], 0
    while pos < len(chunk):
        if pos + 4 > len(chunk):
            raise ProtocolError(f"{where}: BYTES data ends inside an element's 4-byte length.")
        (n,) = struct.unpack_from("<I", chunk, pos)
        if pos + 4 + n > len(chunk):
            raise ProtocolError(f"{where}: a BYTES element of length {n} runs past the data.")
        items.append(chunk[pos + 4:pos + 4 + n])
        pos += 4 + n
    if len(items) != count:
        raise ProtocolError(f"{where}: {len(items)} BYTES elements, but its shape needs "
                            f"{count}.")
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES elements as the binary extension sends them (4-byte length, then the bytes).

    Example:
        >>> serialize_bytes(np.array([b"ab"], dtype=object))
        b'\\x02\\x00\\x00\\x00ab'
    """
    parts = []
    for item in array.reshape(-1):
        data = item if isinstance(item, bytes) else str(item).encode()
        parts += [struct.pack("<I", len(data)), data]
    return b"".join(parts)


def _flatten(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    if all(not isinstance(v, list) for v in data):
        return data
    flat: list = []
    stack = [iter(data)]
    while stack:  # iterative: a deeply nested list must not hit the recursion limit
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            flat.append(v)
        else:
            stack.pop()
    return flat


def _from_json(data: Any, datatype: str, count: int, where: str) -> np.ndarray:
    if isinstance(data, jsonnum.Numbers):
        return _from_numbers(data, datatype, count, where)
    flat = _flatten(data)
    if len(flat) != count:
        raise ProtocolError(f"{where}: 'data' has {len(flat)} elements, but its shape "
                            f"needs {count}.")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise ProtocolError(f"{where}: BYTES data in JSON must be strings.")
        array = np.empty(count, dtype=object)
        array[:] = [v.encode() for v in flat]
        return array
    if datatype == "BOOL":
        ok = all(type(v) is bool for v in flat)
    elif datatype in _INTS:
        ok = all(type(v) is int for v in flat)
    else:
        ok = all(_fits_kind(v, datatype) for v in flat)
    if not ok:
        kind = {"BOOL": "true/false"}.get(datatype, "integers" if datatype in _INTS
                                          else 'numbers (or "NaN", "Infinity", "-Infinity")')
        bad = next(v for v in flat if not _fits_kind(v, datatype))
        raise ProtocolError(f"{where}: datatype {datatype} needs {kind} in 'data', got "
                            f"{bad!r}.")
    if datatype in _FLOATS:
        flat = [NON_FINITE_VALUES[v] if type(v) is str else v for v in flat]
    try:
        if datatype == "BF16":
            return np.array(flat, dtype=np.float32).astype(DTYPES["BF16"])
        return np.array(flat, dtype=DTYPES[datatype])
    except OverflowError:
        raise ProtocolError(f"{where}: a value in 'data' is out of range for "
                            f"{datatype}.") from None


def _from_numbers(data: jsonnum.Numbers, datatype: str, count: int,
                  where: str) -> np.ndarray:
    """The checks and conversion of :func:`_from_json`, on numbers already in numpy."""
    flat = data.array
    if len(flat) != count:
        raise ProtocolError(f"{where}: 'data' has {len(flat)} elements, but its shape "
                            f"needs {count}.")
    if datatype in ("BYTES", "BOOL"):
        kind = "strings" if datatype == "BYTES" else "true/false"
        raise ProtocolError(f"{where}: datatype {datatype} needs {kind} in 'data', got "
                            f"numbers such as {flat[0].item()!r}.")
    if datatype in _INTS and not data.integral:
        raise ProtocolError(f"{where}: datatype {datatype} needs integers in 'data', got "
                            "numbers written with a decimal point or an exponent.")
    dtype = DTYPES[datatype]
    if datatype in _INTS:
        info = np.iinfo(dtype)
        if count and (flat.min() < info.min or flat.max() > info.max):
            raise ProtocolError(f"{where}: a value in 'data' is out of range for "
                                f"{datatype}.")
    if datatype == "BF16":
        return flat.astype(np.float32).astype(dtype)
    return flat.astype(dtype)


def _fits_kind(v: Any, datatype: str) -> bool:
    if datatype == "BOOL":
        return type(v) is bool
    if datatype in _INTS:
        return type(v) is int
    return type(v) in (int, float) or (type(v) is str and v in NON_FINITE_VALUES)


def _parse_output(raw: Any, i: int) -> OutputRequest:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ProtocolError(f"outputs[{i}] must be an object with a string 'name'.")
    params = _dict_field(raw, "parameters", f"output {raw['name']!r}")
    if params.get("classification"):
        raise ProtocolError(f"output {raw['name']!r}: the classification extension is not "
                            "supported. Ask for the raw output and take the top-k yourself.")
    for key in _SHARED_MEMORY:
        if key in params:
            raise ProtocolError(f"output {raw['name']!r}: {key}: this server has no "
                                "shared-memory support.")
    binary = params.get("binary_data")
    if binary is not None and not isinstance(binary, bool):
        raise ProtocolError(f"output {raw['name']!r}: binary_data must be true or false.")
    return OutputRequest(raw["name"], binary)


def encode_infer_response(model_name: str, model_version: str, request_id: str | None,
                          outputs: list[tuple[Tensor, bool]]) -> tuple[bytes, int | None]:
    """The response body, and the JSON length when binary data follows it (else None).

    Args:
        outputs: each output tensor with whether to send it as binary data.

    Example:
        >>> t = Tensor("y", "FP32", np.ones((1, 2), np.float32))
        >>> body, n = encode_infer_response("m", "1", None, [(t, False)])
        >>> json.loads(body)["outputs"][0]["data"], n
        ([1.0, 1.0], None)
    """
    entries, chunks = [], []
    for tensor, binary in outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                                 "shape": list(tensor.array.shape)}
        if binary:
            if tensor.datatype == "BYTES":
                raw = serialize_bytes(tensor.array)
            else:
                raw = np.ascontiguousarray(tensor.array, DTYPES[tensor.datatype]).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = _to_json(tensor)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        doc["id"] = request_id
    doc["outputs"] = entries
    head = dump_json(doc)
    if not chunks:
        return head, None
    return b"".join([head, *chunks]), len(head)


def dump_json(doc: Any) -> bytes:
    """``doc`` as compact RFC 8259 JSON: a NaN or an infinity that reaches it is a bug
    (``ValueError``), never a bare ``NaN`` that strict parsers reject.

    Example:
        >>> dump_json({"a": [1, "NaN"]})
        b'{"a":[1,"NaN"]}'
    """
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _to_json(tensor: Tensor) -> list:
    flat = tensor.array.reshape(-1)
    if tensor.datatype == "BYTES":
        try:
            return [v.decode() if isinstance(v, bytes) else str(v) for v in flat]
        except UnicodeDecodeError:
            raise ProtocolError(f"output {tensor.name!r} holds bytes that are not UTF-8 "
                                "text. Ask for it with binary_data = true.") from None
    if tensor.datatype == "BF16":
        flat = flat.astype(np.float32)
    values = flat.tolist()
    if tensor.datatype in _FLOATS:
        # JSON has no NaN or infinity: they travel as the strings protobuf's JSON mapping
        # uses, which numpy (and so tritonclient's as_numpy) reads back as floats.
        for i in np.flatnonzero(~np.isfinite(flat)).tolist():
            values[i] = NON_FINITE_TEXT[values[i]] if values[i] == values[i] else "NaN"
    return values
