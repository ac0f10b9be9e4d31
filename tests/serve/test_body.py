"""A request body in one buffer, in shared memory for the parse processes; the heap
handed back after large requests."""

import json
import platform
import subprocess
import sys
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest

from gpufleet.serve.body import Body, parse_shared
from gpufleet.serve.protocol import ProtocolError
from gpufleet.serve.trim import trim_heap


def _body(n: int) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, n],
                                   "data": list(range(n))}]}).encode()


def test_a_shared_body_is_parsed_by_name_and_unlinked_after():
    raw = _body(5000)
    body = Body()
    body.allocate(len(raw), shared=True)
    for i in range(0, len(raw), 1000):  # as chunks arrive
        body.append(raw[i:i + 1000])
    req = parse_shared(body.shm.name, body.size, None)
    np.testing.assert_array_equal(req.inputs[0].array, np.arange(5000, dtype=np.float32)[None])
    name = body.shm.name
    body.release()
    body.release()  # twice: nothing left to free
    with pytest.raises(FileNotFoundError):
        SharedMemory(name)


def test_a_bad_shared_body_raises_the_protocol_error_and_can_still_be_freed():
    raw = b'{"inputs": [' + b" " * 300_000
    body = Body()
    body.allocate(len(raw), shared=True)
    body.append(raw)
    with pytest.raises(ProtocolError, match="not valid JSON") as caught:
        parse_shared(body.shm.name, body.size, None)
    assert caught.value.status == 400
    body.release()


def test_a_body_longer_than_declared_is_refused():
    body = Body()
    body.allocate(10)
    body.append(b"0123456789")
    with pytest.raises(ProtocolError, match="longer than its Content-Length"):
        body.append(b"!")
    assert bytes(body.bytes()) == b"0123456789"


def test_a_body_without_a_length_grows():
    body = Body()
    for chunk in (b"ab", b"cd"):
        body.append(chunk)
    assert bytes(body.bytes()) == b"abcd"


def test_heap_tuning_answers_on_glibc():
    glibc = platform.libc_ver()[0] == "glibc"
    code = "from gpufleet.serve.trim import fix_mmap_threshold; print(fix_mmap_threshold())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout  # its own process: the setting is process-wide
    assert out.strip() == str(glibc)  # mallopt returns 1 when it takes the setting
    assert trim_heap() in (True, False)
