"""Hand freed heap memory back to the operating system after a large request.

glibc keeps freed memory in its heap: after a 30 MiB request it also raises its mmap
threshold, so the next large buffers come from the heap too and the process's RSS stays
at its peak. ``malloc_trim(0)`` returns the free pages; it is a no-op where the C library
is not glibc (musl, macOS), and costs about a millisecond. The parse processes, which do
nothing else, also fix the mmap threshold, so that their large buffers are unmapped when
freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from gpufleet.serve.protocol import InferRequest, parse_infer_request

log = logging.getLogger(__name__)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 256 * 1024  # fixed: larger blocks are mapped, and unmapped on free


def _load(name: str):
    libc = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(libc), name) if libc else None
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return None


_MALLOC_TRIM = _load("malloc_trim")
_MALLOPT = _load("mallopt")


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS; True when glibc released any.

    Example:
        >>> trim_heap() in (True, False)
        True
    """
    if _MALLOC_TRIM is None:
        return False
    return bool(_MALLOC_TRIM(0))


def fix_mmap_threshold() -> bool:
    """Stop glibc from raising its mmap threshold after a large free (what the parse
    processes run at start): every block over 256 KiB is then its own mapping, returned
    to the OS when freed. True when glibc took the setting.
    """
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def parse_and_trim(body: bytes | bytearray, header_length: str | None) -> InferRequest:
    """:func:`~gpufleet.serve.protocol.parse_infer_request`, then :func:`trim_heap` (what
    the parse processes run: the body's text is freed when the parse returns)."""
    try:
        return parse_infer_request(body, header_length)
    finally:
        del body
        trim_heap()
