"""Random access to the records of a JSON Lines file through a line-offset index.

The first open scans the file once, with numpy over large chunks, and writes the start
offset of every record to a small binary index next to the data (``<path>.idx``). Later
opens only read the index header, check it against the data file's size and modification
time, and reuse it. Item ``i`` is then one slice of the memory-mapped data file and one
``json.loads``: nothing is held in Python lists, so memory stays flat however long the
file is, and DataLoader workers share the operating system's page cache.

Index file layout (little-endian), ``INDEX_VERSION`` 1:

=======  ======  ==============================================================
offset   type    field
=======  ======  ==============================================================
0        8 B     magic ``b"GFJSONL\\0"``
8        uint32  format version
12       uint32  flags: bit 0 set when built with ``on_error="skip"``
16       int64   data file size in bytes
24       int64   data file ``st_mtime_ns``
32       int64   ``n_items``: records in the index
40       int64   ``n_dropped``: lines left out (empty, plus malformed in skip mode)
48       int64   ``n_skipped``: malformed lines left out (skip mode only)
56       int64   ``n_listed``: malformed line numbers stored (at most ``MAX_LISTED``)
64       int64   ``n_items + 1`` offsets: start of each record, then the file size
...      int64   ``n_dropped`` values ``d_j - j - 1`` (``d_j``: 1-based line number of
                 the j-th dropped line), i.e. the records before each dropped line
...      int64   ``n_listed`` 1-based line numbers of the first malformed lines
=======  ======  ==============================================================
"""

from __future__ import annotations

import json
import logging
import operator
import os
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from gpufleet.errors import JsonlError, unknown_choice

log = logging.getLogger(__name__)

INDEX_MAGIC = b"GFJSONL\0"
INDEX_VERSION = 1
_HEADER = struct.Struct("<8sII6q")  # 64 bytes; the offsets that follow stay 8-byte aligned
_FLAG_SKIP = 1
MAX_LISTED = 10  # malformed line numbers kept for ``JsonlDataset.skipped_lines``
CHUNK_BYTES = 64 << 20  # bytes scanned per numpy pass while building the index
_ON_ERROR = ("raise", "skip")
_NEWLINE, _CR = 10, 13


def _excerpt(raw: bytes, limit: int = 80) -> str:
    text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    return text if len(text) <= limit else text[:limit] + "..."


def _malformed(path: Path, line: int, raw: bytes, exc: ValueError) -> JsonlError:
    reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
    return JsonlError(f"{path}:{line}: malformed JSON ({reason}): {_excerpt(raw)!r}. Fix the "
                      "line, or pass on_error='skip' to leave malformed lines out.")


@dataclass(frozen=True)
class _Header:
    flags: int
    size: int
    mtime_ns: int
    n_items: int
    n_dropped: int
    n_skipped: int
    n_listed: int

    def pack(self) -> bytes:
        return _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, self.flags, self.size, self.mtime_ns,
                            self.n_items, self.n_dropped, self.n_skipped, self.n_listed)

    @property
    def index_bytes(self) -> int:
        return _HEADER.size + 8 * (self.n_items + 1 + self.n_dropped + self.n_listed)


def _read_header(index_path: Path) -> _Header | None:
    """Return the index header, or ``None`` when the file is missing or not an index."""
    try:
        with open(index_path, "rb") as f:
            raw = f.read(_HEADER.size)
            actual = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return None
    if len(raw) != _HEADER.size:
        return None
    magic, version, *fields = _HEADER.unpack(raw)
    if magic != INDEX_MAGIC or version != INDEX_VERSION:
        return None
    header = _Header(*fields)
    return header if header.index_bytes == actual else None  # truncated or foreign file


def _line_spans(data: np.ndarray, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(starts, ends)`` of the lines of ``data`` (newlines excluded), chunk by chunk.

    Only the newline search touches every byte, and it runs in numpy: one comparison and
    one ``flatnonzero`` per ``CHUNK_BYTES``. A last line without a newline is yielded too.
    """
    line_start = 0
    for lo in range(0, size, CHUNK_BYTES):
        newlines = np.flatnonzero(data[lo:lo + CHUNK_BYTES] == _NEWLINE) + lo
        if newlines.size:
            starts = np.empty_like(newlines)
            starts[0] = line_start
            starts[1:] = newlines[:-1] + 1
            line_start = int(newlines[-1]) + 1
            yield starts, newlines
    if line_start < size:
        yield np.array([line_start], dtype=np.int64), np.array([size], dtype=np.int64)


def _invalid_lines(data: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                   check: np.ndarray) -> np.ndarray:
    """Return a mask of the lines (among ``check``) that ``json.loads`` rejects."""
    bad = np.zeros(len(starts), dtype=bool)
    if not len(starts):
        return bad
    # One copy and one C-level split for the whole batch: line k is lines[k].
    lines = data[starts[0]:ends[-1]].tobytes().split(b"\n")
    assert len(lines) == len(starts)
    loads = json.loads
    for k in np.flatnonzero(check).tolist():
        try:
            loads(lines[k])
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            bad[k] = True
    return bad


def _build_index(path: Path, index_path: Path, validate: bool) -> _Header:
    """Scan ``path`` and write its index to ``index_path`` atomically; return the header."""
    stat = os.stat(path)
    size = stat.st_size
    tmp = index_path.with_name(f"{index_path.name}.tmp{os.getpid()}")
    dropped: list[np.ndarray] = []  # 1-based line numbers of the lines left out
    listed: list[int] = []
    n_items = n_skipped = lines_seen = 0
    t0 = time.perf_counter()
    try:
        with open(tmp, "wb") as out:
            out.write(bytes(_HEADER.size))  # placeholder; the real header goes in last
            data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.empty(0, np.uint8)
            for starts, ends in _line_spans(data, size):
                length = ends - starts
                # Empty lines: no bytes, or a lone "\r" (a blank line of a CRLF file).
                one = np.flatnonzero(length == 1)
                empty = length == 0
                empty[one] = data[starts[one]] == _CR
                keep = ~empty
                if validate:
                    bad = _invalid_lines(data, starts, ends, keep)
                    if bad.any():
                        bad_lines = np.flatnonzero(bad) + lines_seen + 1
                        n_skipped += len(bad_lines)
                        listed.extend(bad_lines[:MAX_LISTED - len(listed)].tolist())
                        keep &= ~bad
                if not keep.all():
                    dropped.append(np.flatnonzero(~keep) + lines_seen + 1)
                kept = starts[keep]
                out.write(kept.astype("<i8", copy=False).tobytes())
                n_items += len(kept)
                lines_seen += len(starts)
            del data  # unmap before the index replaces anything
            out.write(np.array([size], dtype="<i8").tobytes())  # end sentinel
            gaps = np.concatenate(dropped) if dropped else np.empty(0, np.int64)
            # Store d_j - j - 1 (records before the j-th dropped line): non-decreasing, so
            # line_number() finds how many dropped lines precede a record by bisection.
            out.write((gaps - np.arange(len(gaps)) - 1).astype("<i8").tobytes())
            out.write(np.array(listed, dtype="<i8").tobytes())
            header = _Header(_FLAG_SKIP if validate else 0, size, stat.st_mtime_ns, n_items,
                             len(gaps), n_skipped, len(listed))
            out.seek(0)
            out.write(header.pack())
        os.replace(tmp, index_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - t0
    log.info("indexed %s: %d records in %d lines, %.2f s (%.0f lines/s)%s", path, n_items,
             lines_seen, seconds, lines_seen / max(seconds, 1e-9),
             " with validation" if validate else "")
    return header


class JsonlDataset(Dataset):
    """The records of a JSON Lines file, one ``json.loads`` per item, in O(1) each.

    The line-offset index (see the module docstring for its layout) is built on first use
    and rebuilt, atomically, whenever the data file's size or modification time differs
    from the one recorded in the index, or ``on_error`` differs from the one it was built
    with. Building takes one numpy pass over the file (millions of lines a second).

    Empty lines (no bytes, or a lone ``"\\r"``) are not records: they are left out of the
    index, and ``len()`` does not count them. A last line without a trailing newline is a
    record. Lines of only spaces are not empty: they are malformed.

    ``on_error="raise"`` (the default) does not parse anything while indexing: a malformed
    line raises :class:`JsonlError` (a ``ValueError``) when its item is read, naming the
    file, the 1-based line number and an excerpt. ``on_error="skip"`` parses every line
    once while indexing (about as slow as reading the whole file with ``json.loads``, i.e.
    a few hundred thousand lines a second, paid once per data file), leaves malformed
    lines out of the index and logs one warning with their count.

    The memory maps are opened lazily in each process and never pickled, so DataLoader
    workers re-open them and share the page cache instead of copying the data.

    Attributes:
        path: the data file.
        index_path: the index file.
        skipped: malformed lines left out (always 0 with ``on_error="raise"``).
        skipped_lines: 1-based line numbers of the first (up to ``MAX_LISTED``) of them.

    Example:
        >>> import tempfile
        >>> path = tempfile.mkdtemp() + "/data.jsonl"
        >>> _ = open(path, "w").write('{"a": 1}\\n\\n{"a": 2}\\n')
        >>> ds = JsonlDataset(path)
        >>> len(ds), ds[1], ds.line_number(1)
        (2, {'a': 2}, 3)
    """

    def __init__(self, path: str | Path, *, index_path: str | Path | None = None,
                 on_error: str = "raise", transform: Callable[[Any], Any] | None = None,
                 ) -> None:
        if on_error not in _ON_ERROR:
            raise ValueError(unknown_choice("on_error", on_error, _ON_ERROR))
        self.path = Path(path)
        if not self.path.is_file():
            raise JsonlError(f"{self.path}: no such file. Pass the path of a JSON Lines file.")
        self.index_path = Path(index_path) if index_path is not None else Path(f"{path}.idx")
        self.on_error = on_error
        self.transform = transform
        header = self._load_or_build_index()
        self._header = header
        self.skipped = header.n_skipped
        self.skipped_lines = self._read_listed(header)
        if self.skipped:
            log.warning("%s: skipped %d malformed line(s) (first at line(s) %s)", self.path,
                        self.skipped, ", ".join(map(str, self.skipped_lines)))
        # Opened lazily, once per process (see __getstate__).
        self._data: np.ndarray | None = None
        self._offsets: np.ndarray | None = None
        self._gaps: np.ndarray | None = None

    def _load_or_build_index(self) -> _Header:
        stat = os.stat(self.path)
        flags = _FLAG_SKIP if self.on_error == "skip" else 0
        header = _read_header(self.index_path)
        if (header is not None and header.size == stat.st_size
                and header.mtime_ns == stat.st_mtime_ns and header.flags == flags):
            return header
        log.info("%s: building the line index %s", self.path, self.index_path)
        try:
            return _build_index(self.path, self.index_path, validate=bool(flags))
        except PermissionError as exc:
            raise JsonlError(f"{self.path}: cannot write its index to {self.index_path} "
                             f"({exc.strerror}). Pass index_path= a writable location.") from exc

    def _read_listed(self, header: _Header) -> list[int]:
        if not header.n_listed:
            return []
        listed = np.fromfile(self.index_path, dtype="<i8", count=header.n_listed,
                             offset=header.index_bytes - 8 * header.n_listed)
        return listed.tolist()

    def _open(self) -> None:
        """Map the data and the index in this process (the first item read in each)."""
        h = self._header
        stat = os.stat(self.path)
        if (stat.st_size, stat.st_mtime_ns) != (h.size, h.mtime_ns):
            raise JsonlError(f"{self.path} changed after its index was loaded (size {h.size} "
                             f"-> {stat.st_size} bytes). Create the JsonlDataset again to "
                             "re-index it, and do not modify data files during training.")
        index = np.memmap(self.index_path, dtype="<i8", mode="r", offset=_HEADER.size,
                          shape=(h.index_bytes - _HEADER.size) // 8)
        self._offsets = index[:h.n_items + 1]
        self._gaps = index[h.n_items + 1:h.n_items + 1 + h.n_dropped]
        self._data = (np.memmap(self.path, dtype=np.uint8, mode="r") if h.size
                      else np.empty(0, np.uint8))

    def __len__(self) -> int:
        return self._header.n_items

    def _check(self, i: int) -> int:
        i = operator.index(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of range for {n} records in {self.path}")
        return i % n

    def line_number(self, i: int) -> int:
        """Return the 1-based line number in the file of item ``i``.

        Differs from ``i + 1`` only after empty (or skipped) lines; O(log n_dropped).

        Example:
            >>> ds.line_number(0)  # doctest: +SKIP
            1
        """
        i = self._check(i)
        if self._gaps is None:
            self._open()
        assert self._gaps is not None
        return i + 1 + int(np.searchsorted(self._gaps, i, side="right"))

    def raw(self, i: int) -> bytes:
        """Return the bytes of the line of item ``i``, without its line ending."""
        i = self._check(i)
        if self._data is None:
            self._open()
        assert self._data is not None and self._offsets is not None
        start, stop = self._offsets[i:i + 2].tolist()
        line = self._data[start:stop].tobytes()
        # The slice runs to the next record, so it may hold dropped lines after this one.
        end = line.find(b"\n")
        return line if end < 0 else line[:end]

    def __getitem__(self, i: int) -> Any:
        line = self.raw(i)
        try:
            item = json.loads(line)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise _malformed(self.path, self.line_number(i), line, exc) from None
        return self.transform(item) if self.transform is not None else item

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers (and spawn) get the paths, not the maps: each re-opens them.
        state = self.__dict__.copy()
        state["_data"] = state["_offsets"] = state["_gaps"] = None
        return state

    def __repr__(self) -> str:
        return (f"JsonlDataset({str(self.path)!r}, records={len(self)}, "
                f"on_error={self.on_error!r}, skipped={self.skipped})")
