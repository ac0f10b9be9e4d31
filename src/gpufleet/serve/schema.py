"""The shapes of the protocol's request bodies, as data, and the check against them.

Every request body is checked against its schema before any field is used, so a field of
the wrong JSON type (a ``datatype`` that is an object, a ``shape`` that is a string, a
parameter that is a list) is a 400 naming the field, never an error deep in the server.
The schemas follow the Open Inference Protocol (KServe v2) REST specification and
Triton's model repository extension:

- a *parameters* object maps names to a string, a number or a boolean;
- an inference request has an optional string ``id``, optional ``parameters``, a
  non-empty ``inputs`` list and an optional ``outputs`` list;
- an input has a string ``name``, a ``shape`` list of integers, a string ``datatype``,
  optional ``parameters`` and ``data`` (a list, nested or flat; the binary tensor
  extension may carry the data after the JSON instead);
- an output has a string ``name`` and optional ``parameters``.

A schema is a small subset of JSON Schema: ``type`` (one name or a tuple), ``properties``,
``required``, ``items``, ``values`` (the schema of every value of an object) and
``min_items``. Unknown fields are allowed, as the specification does. A field that is
``null`` counts as absent.
"""

from __future__ import annotations

import reprlib
from typing import Any

from gpufleet.serve.jsonnum import Numbers

Schema = dict[str, Any]

PARAMETERS: Schema = {"type": "object", "values": {"type": ("string", "number", "boolean")}}

REQUEST_INPUT: Schema = {
    "type": "object",
    "required": ("name", "shape", "datatype"),
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "datatype": {"type": "string"},
        "parameters": PARAMETERS,
        "data": {"type": "array"},
    },
}

REQUEST_OUTPUT: Schema = {
    "type": "object",
    "required": ("name",),
    "properties": {"name": {"type": "string"}, "parameters": PARAMETERS},
}

INFER_REQUEST: Schema = {
    "type": "object",
    "required": ("inputs",),
    "properties": {
        "id": {"type": "string"},
        "parameters": PARAMETERS,
        "inputs": {"type": "array", "min_items": 1, "items": REQUEST_INPUT},
        "outputs": {"type": "array", "items": REQUEST_OUTPUT},
    },
}

# Triton's model repository extension: POST v2/repository/index, .../load, .../unload.
REPOSITORY_INDEX_REQUEST: Schema = {"type": "object",
                                    "properties": {"ready": {"type": "boolean"}}}
LOAD_REQUEST: Schema = {"type": "object", "properties": {"parameters": PARAMETERS}}
UNLOAD_REQUEST: Schema = LOAD_REQUEST

_REPR = reprlib.Repr()  # Python 3.11's Repr takes no arguments
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxstring = 2, 3, 4, 40
_NAMES = {"string": "a string", "integer": "an integer", "number": "a number",
          "boolean": "a boolean", "array": "an array", "object": "an object",
          "null": "null"}


def json_type(value: Any) -> str:
    """The JSON type name of a parsed value (``Numbers`` is an array).

    Example:
        >>> json_type(True), json_type(3), json_type(2.5), json_type({})
        ('boolean', 'integer', 'number', 'object')
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, Numbers)):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise TypeError(f"not a parsed JSON value: {type(value).__name__}")


def _fits(value: Any, types: tuple[str, ...]) -> bool:
    kind = json_type(value)
    if kind == "integer" and "number" in types:
        return True
    if isinstance(value, Numbers) and "integer" in types:
        return False  # a list of numbers is not one number
    return kind in types


def problem(value: Any, schema: Schema, where: str) -> str | None:
    """What is wrong with ``value`` against ``schema``, naming the first field that does
    not fit (``where`` names ``value``), or None when it fits.

    Example:
        >>> problem({"inputs": [{"name": "x", "shape": [1], "datatype": {}}]},
        ...         INFER_REQUEST, "the request")[:60]
        'the request: inputs[0].datatype must be a string, got an obj'
    """
    found = _problem(value, schema, "")
    if found is None:
        return None
    path, what = found
    field = f"{path.lstrip('.')} " if path else ""
    return (f"{where}: {field}{what}. The Open Inference "
            'Protocol\'s request is {"inputs": [{"name": str, "shape": [int], "datatype": '
            'str, "data": [...]}], "outputs": [{"name": str}]}; parameters map names to '
            "strings, numbers or booleans.")


def _problem(value: Any, schema: Schema, path: str) -> tuple[str, str] | None:
    """The path of the first field that does not fit, and what is wrong with it."""
    types = schema["type"] if isinstance(schema["type"], tuple) else (schema["type"],)
    if not _fits(value, types):
        names = [_NAMES[t] for t in types]
        wanted = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        return path, f"must be {wanted}, got {_describe(value)}"
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                return f"{path}.{key}", "is missing"
        for key, sub in schema.get("properties", {}).items():
            if (key in value and value[key] is not None) or key in schema.get("required", ()):
                found = _problem(value[key], sub, f"{path}.{key}")
                if found:
                    return found
        if "values" in schema:
            for key, v in value.items():
                found = _problem(v, schema["values"], f"{path}.{key}")
                if found:
                    return found
    elif isinstance(value, list):
        if len(value) < schema.get("min_items", 0):
            return path, f"must be an array of at least {schema['min_items']} item(s), got []"
        if "items" in schema:
            for i, item in enumerate(value):
                found = _problem(item, schema["items"], f"{path}[{i}]")
                if found:
                    return found
    return None


def _describe(value: Any) -> str:
    if isinstance(value, Numbers):
        return f"an array of {len(value.array)} numbers"
    text = _REPR.repr(value)  # bounded: a field may hold megabytes
    kind = json_type(value)
    article = "an" if kind[0] in "aeiou" else "a"
    return f"{article} {kind} ({text})"
