"""A parsed request against the model's signature: its inputs, its wanted outputs."""

from __future__ import annotations

import numpy as np

from gpufleet.errors import unknown_choice
from gpufleet.serve.model import ServedModel
from gpufleet.serve.protocol import InferRequest, ProtocolError


def check_inputs(model: ServedModel, req: InferRequest, max_batch_size: int) -> list[np.ndarray]:
    """The request's input arrays in the model's order, after checking names, datatypes,
    shapes and the batch size against the model's signature."""
    given = {}
    for t in req.inputs:
        if t.name in given:
            raise ProtocolError(f"input {t.name!r} appears twice in the request.")
        given[t.name] = t
    names = [s.name for s in model.inputs]
    for name in given:
        if name not in names:
            raise ProtocolError(unknown_choice(f"model {model.name!r}: input", name, names))
    arrays, batch = [], None
    for spec in model.inputs:
        t = given.get(spec.name)
        if t is None:
            raise ProtocolError(f"model {model.name!r} needs input {spec.name!r} "
                                f"({spec.datatype}, shape {[-1, *spec.dims]}); the request "
                                "does not have it.")
        shape = t.array.shape
        want = f"{[-1, *spec.dims]}"
        if t.datatype != spec.datatype:
            raise ProtocolError(f"input {spec.name!r}: datatype {t.datatype}, but model "
                                f"{model.name!r} takes {spec.datatype}.")
        if len(shape) != len(spec.dims) + 1 or any(
                d not in (-1, n) for d, n in zip(spec.dims, shape[1:])):
            raise ProtocolError(f"input {spec.name!r}: shape {list(shape)} does not match "
                                f"{want} (batch first, -1 = any size).")
        if not 1 <= shape[0] <= max_batch_size:
            raise ProtocolError(f"input {spec.name!r}: batch size {shape[0]} is outside 1.."
                                f"{max_batch_size} (the server's --max-batch-size).")
        if batch is not None and shape[0] != batch:
            raise ProtocolError(f"input {spec.name!r} has {shape[0]} rows but another input "
                                f"has {batch}; every input needs the same batch size.")
        batch = shape[0]
        arrays.append(t.array)
    return arrays


def wanted_outputs(model: ServedModel, req: InferRequest) -> list[tuple[str, bool]]:
    """The outputs to send (every one when the request names none), each with whether
    it goes as binary data."""
    names = [s.name for s in model.outputs]
    if req.outputs is None:
        return [(n, req.binary_output) for n in names]
    wanted = []
    for out in req.outputs:
        if out.name not in names:
            raise ProtocolError(unknown_choice(f"model {model.name!r}: output", out.name,
                                               names))
        wanted.append((out.name, req.binary_output if out.binary is None else out.binary))
    return wanted
