"""The default job's corpus: this interpreter's own standard-library sources, as bytes.

No download: every Python install carries a few tens of MB of real code. The ``*.py``
files are read in a fixed order, joined with newlines, capped at ``max_bytes`` and cached
as a flat ``uint8`` token file (one byte = one token, vocabulary 256).
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gpufleet.errors import ConfigError
from gpufleet.files import fsync_dir

log = logging.getLogger(__name__)

SKIP_DIRS = frozenset({"site-packages", "dist-packages"})  # installed packages, not stdlib
SEPARATOR = b"\n"  # between two files


def default_cache_dir() -> Path:
    """``$GPUFLEET_CACHE`` if set, else ``~/.cache/gpufleet``."""
    return Path(os.environ.get("GPUFLEET_CACHE") or Path.home() / ".cache" / "gpufleet")


def build_stdlib_corpus(max_bytes: int = 4_000_000,
                        cache_dir: str | Path | None = None) -> Path:
    """Build (or reuse) the byte-level token file made of the stdlib's ``*.py`` sources.

    The file is ``<cache>/corpus/stdlib-py{major}{minor}-{max_bytes}.bin``, where
    ``<cache>`` is ``cache_dir``, else ``$GPUFLEET_CACHE``, else ``~/.cache/gpufleet``.
    An existing file of the right size is reused. The file is written to a temporary name
    and renamed into place, so ranks or nodes that build it at the same time never see a
    half-written file.

    Args:
        max_bytes: size cap; the file holds ``min(max_bytes, bytes of all sources)``.
        cache_dir: where to cache the file (see above).

    Returns:
        Path to the token file (``numpy.uint8`` tokens, one per byte).

    Raises:
        ValueError: ``max_bytes`` is not a positive integer.
        ConfigError: the interpreter has no ``*.py`` sources (a stripped install).

    Example:
        >>> path = build_stdlib_corpus(max_bytes=100_000, cache_dir="/tmp/gpufleet-cache")
        >>> path.stat().st_size
        100000
    """
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ValueError(f"max_bytes = {max_bytes!r}: must be a positive integer "
                         "(the corpus size cap in bytes, e.g. 4_000_000).")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources(root)
    if not files:
        raise ConfigError(
            f"no *.py sources under this interpreter's standard library ({root}); it may be "
            "a stripped install that ships only bytecode. Train on your own data instead: "
            "--data package.module:factory (a function returning a Dataset).")
    sizes = [f.stat().st_size for f in files]
    expected = min(max_bytes, sum(sizes) + len(SEPARATOR) * (len(files) - 1))

    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    v = sys.version_info
    path = base.expanduser() / "corpus" / f"stdlib-py{v.major}{v.minor}-{max_bytes}.bin"
    if path.is_file() and path.stat().st_size == expected:
        log.debug("reusing corpus %s (%d bytes)", path, expected)
        return path
    log.info("building the stdlib corpus from %d files under %s: %d bytes -> %s",
             len(files), root, expected, path)
    written = _write_atomic(path, _joined(files, max_bytes))
    # Sources changed between listing and reading: the file is still valid, only the next
    # call will not recognise it and build it again.
    if written != expected:
        log.warning("corpus %s has %d bytes, %d were expected from the file sizes",
                    path, written, expected)
    return path


def stdlib_sources(root: str | Path) -> list[Path]:
    """Every readable ``*.py`` file under ``root``, outside site-/dist-packages, sorted by
    relative path (so the order is the same on every machine with the same install).

    Example:
        >>> import sysconfig
        >>> files = stdlib_sources(sysconfig.get_paths()["stdlib"])
        >>> any(f.name == "os.py" for f in files)
        True
    """
    root = Path(root)
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):  # symlinked dirs are not followed
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            path = Path(dirpath, name)
            if name.endswith(".py") and path.is_file() and os.access(path, os.R_OK):
                found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


def _joined(files: list[Path], max_bytes: int) -> Iterator[bytes]:
    """The files' bytes separated by ``SEPARATOR``, stopping at ``max_bytes`` in total."""
    left = max_bytes
    for i, path in enumerate(files):
        for chunk in (SEPARATOR if i else b"", path.read_bytes()):
            piece = chunk[:left]
            left -= len(piece)
            yield piece
            if left == 0:
                return


def _write_atomic(path: Path, chunks: Iterator[bytes]) -> int:
    """Write ``chunks`` to ``path`` via a temporary file in the same directory, fsync'ed and
    renamed into place (``os.replace`` is atomic on one file system). Returns the size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a shared cache needs readers
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # make the rename itself durable
    return size
