"""JSON whose large number arrays are read straight into numpy, without Python objects.

``json.loads`` turns a 30 MiB list of numbers into ~3.3 million Python floats: 32 bytes
each with the list slot, about 3.5x the body, and a heap that stays grown afterwards.
:func:`loads` parses the rest of the document as ``json`` does and hands every array of
at least ``MIN_FAST_CHARS`` characters that holds only numbers (nested to any depth) to
``np.fromstring``, a few MiB at a time, into one preallocated array: the body's text
plus 8 bytes per number at the peak.

An array the fast path cannot read exactly (``true``/``false``, strings, integers of 19
or more digits, malformed text) falls back to ``json``'s own parsing, so every document
parses to what ``json.loads`` gives, or fails with its error, except that a numeric array
comes back as a :class:`Numbers`.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from json.decoder import JSONArray
from json.scanner import py_make_scanner
from typing import Any

import numpy as np

MIN_FAST_CHARS = 4096  # shorter arrays (shapes, small inputs) go through json itself
CHUNK_CHARS = 4 * 2**20  # text handed to numpy at once

_RUN = re.compile(r"[\[\]0-9eE.+\-,\s]*")  # characters a numeric array may hold
_BRACKET = re.compile(r"[\[\]]")
_NOT_INTEGRAL = re.compile(r"[.eE]")
_LONG_INT = re.compile(r"\d{19}")  # may not fit int64 exactly: json decides
_NO_BRACKETS = bytes.maketrans(b"[]", b"  ")


@dataclass
class Numbers:
    """A JSON array of numbers, flattened: ``integral`` when every number is an integer
    literal (no ``.`` or exponent), then ``array`` is int64, else float64."""

    array: np.ndarray
    integral: bool


def loads(text: str | bytes | bytearray | memoryview) -> Any:
    """``json.loads``, with each large all-number array returned as :class:`Numbers`.

    Example:
        >>> doc = loads('{"data": [' + ", ".join(["1.5"] * 2000) + "]}")
        >>> doc["data"].array.shape, doc["data"].integral
        ((2000,), False)
    """
    if not isinstance(text, str):
        text = str(text, "utf-8")
    return _Decoder().decode(text)  # one per call: the scanner keeps state


class _Decoder(json.JSONDecoder):
    """json's pure-Python scanner with the array rule replaced (the C scanner cannot be
    extended; only the few objects and short arrays of a request go through Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.parse_array = _parse_array
        self.scan_once = py_make_scanner(self)


def _parse_array(s_and_end: tuple[str, int], scan_once: Any, *args: Any) -> tuple[Any, int]:
    s, end = s_and_end
    numbers = _numeric_array(s, end - 1)
    if numbers is not None:
        return numbers
    return JSONArray(s_and_end, scan_once, *args)


def _numeric_array(s: str, start: int) -> tuple[Numbers, int] | None:
    """The numeric array whose ``[`` is at ``start`` and the index after its ``]``, or
    None when it is short or holds anything but numbers."""
    run_end = _RUN.match(s, start).end()
    if run_end - start < MIN_FAST_CHARS:
        return None
    depth, close = 0, -1
    for m in _BRACKET.finditer(s, start, run_end):
        depth += 1 if m.group() == "[" else -1
        if depth == 0:
            close = m.start()
            break
    if close < 0:
        return None
    integral = _NOT_INTEGRAL.search(s, start, close) is None
    if integral and _LONG_INT.search(s, start, close):
        return None
    count = s.count(",", start, close) + 1
    out = np.empty(count, np.int64 if integral else np.float64)
    filled, i = 0, start + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns, not raises, on text it cannot read
        while i < close:
            j = s.find(",", min(i + CHUNK_CHARS, close), close)
            j = close if j < 0 else j
            piece = s[i:j].encode("ascii").translate(_NO_BRACKETS)
            try:
                values = np.fromstring(piece, dtype=out.dtype, sep=",")
            except (ValueError, DeprecationWarning):
                return None
            if filled + len(values) > count or len(values) != piece.count(b",") + 1:
                return None
            out[filled:filled + len(values)] = values
            filled += len(values)
            i = j + 1
    if filled != count:
        return None
    return Numbers(out, integral), close + 1


