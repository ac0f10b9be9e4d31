"""A request body in one buffer (in process memory, or shared with the parse processes),
the cap on the bytes of all bodies in flight, and the inflating of compressed bodies.

A body is read into a buffer of its declared length (a list of chunks joined at the end
holds it twice). A large body goes into a POSIX shared-memory block that a parse process
maps by name: handing it over as an argument would pickle it, one copy in each process.
"""

from __future__ import annotations

import contextlib
import zlib
from multiprocessing.shared_memory import SharedMemory

from gpufleet.errors import unknown_choice
from gpufleet.serve.protocol import InferRequest, ProtocolError, parse_infer_request
from gpufleet.serve.trim import trim_heap


class Body:
    """The bytes of one request body, filled as they arrive (empty until
    :meth:`allocate`; without it, it grows chunk by chunk)."""

    def __init__(self, data: bytes | bytearray = b"") -> None:
        self.shm: SharedMemory | None = None
        self.data: bytes | bytearray = data if data else bytearray(0)
        self.capacity: int | None = len(data) if data else None
        self.size = len(data)

    def allocate(self, size: int, shared: bool = False) -> None:
        """Make room for the declared ``size`` bytes, in shared memory if ``shared``."""
        if shared and size:
            self.shm = SharedMemory(create=True, size=size)
        else:
            self.data = bytearray(size)
        self.capacity, self.size = size, 0

    def append(self, chunk: bytes) -> None:
        end = self.size + len(chunk)
        if self.capacity is None:
            self.data += chunk  # type: ignore[operator]  # no declared length: grows as bytes arrive
        elif end > self.capacity:
            raise ProtocolError(f"the request body is longer than its Content-Length "
                                f"({self.capacity} bytes). Send the length of the body.")
        elif self.shm is not None:
            self.shm.buf[self.size:end] = chunk
        else:
            self.data[self.size:end] = chunk
        self.size = end

    def bytes(self) -> bytes | bytearray:
        """The body in process memory (a copy when it is in shared memory)."""
        if self.shm is not None:
            return bytes(self.shm.buf[:self.size])
        if len(self.data) > self.size:  # fewer bytes than declared: what came
            return memoryview(self.data)[:self.size].tobytes()
        return self.data

    def release(self) -> None:
        """Free the buffer (unlink the shared block)."""
        self.data = bytearray(0)
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None


def parse_shared(name: str, size: int, header_length: str | None) -> InferRequest:
    """Parse the body in shared-memory block ``name`` (what a parse process runs), then
    hand the freed heap back to the OS."""
    shm = SharedMemory(name)  # the server unlinks it: this process only maps it
    error = None
    try:
        return parse_infer_request(shm.buf[:size], header_length)
    except ProtocolError as e:  # re-raised below, without the frames that hold views
        error = ProtocolError(str(e), e.status)
    finally:
        with contextlib.suppress(BufferError):  # a view still held: unmapped when freed
            shm.close()
        trim_heap()
    raise error


class InflightBytes:
    """The bytes of the request bodies being handled, against a limit (one event loop:
    no lock needed). Past the limit a request gets 429 and is not read."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def holder(self) -> InflightBytes.Holder:
        return InflightBytes.Holder(self)

    class Holder:
        """What one request holds; :meth:`hold` raises it to ``n`` bytes in all."""

        def __init__(self, pool: InflightBytes) -> None:
            self.pool, self.held = pool, 0

        def hold(self, n: int) -> None:
            extra = n - self.held
            if extra <= 0:
                return
            if self.pool.used + extra > self.pool.limit:
                raise ProtocolError(
                    f"the server is busy: {self.pool.used:,} bytes of requests are in flight "
                    f"and this one needs {n:,} more than the limit of {self.pool.limit:,} "
                    "allows (--max-inflight-bytes). Retry shortly, or send smaller requests.",
                    status=429)
            self.pool.used += extra
            self.held = n

        def release(self) -> None:
            self.pool.used -= self.held
            self.held = 0


def decompress(body: bytes | bytearray, encoding: str, limit: int) -> bytes | bytearray:
    """A gzip or deflate body inflated, refused (413) past ``limit`` bytes."""
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding.lower())
    if wbits is None:
        raise ProtocolError(unknown_choice("Content-Encoding", encoding,
                                           ("gzip", "deflate", "identity")), status=415)
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise ProtocolError(f"the {encoding} request body cannot be decompressed: {e}.") \
            from None
    if len(out) > limit:
        raise ProtocolError(f"the decompressed request body exceeds the server's limit of "
                            f"{limit} bytes (--max-body-bytes).", status=413)
    return out
