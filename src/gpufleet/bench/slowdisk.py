"""A slow file system on demand: the kernel's block-I/O throttle on one disk.

:func:`slow_disk` makes a control group whose writes to the disk holding a path are held
to a rate (cgroup v1 ``blkio.throttle.write_bps_device``, or v2 ``io.max``), and gives
the command prefix that starts a program inside it; :func:`joined` moves this process in
and out again. Writes that reach the disk while the caller waits for them (``fsync``,
``O_DIRECT``: what a checkpoint save does) are throttled; writes left in the page cache
are not. Benchmarks use it to measure checkpoints on a slow or shared file system;
changing control groups needs root, and :func:`slow_disk_missing` says why it cannot run.

Example:
    >>> with slow_disk(Path("runs"), 8 * 2**20) as prefix:  # doctest: +SKIP
    ...     subprocess.run([*prefix, "python", "-m", "gpufleet", "train"])
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_BLKIO = Path("/sys/fs/cgroup/blkio")  # cgroup v1
_UNIFIED = next((p for p in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
                 if (p / "cgroup.controllers").exists()), None)  # cgroup v2


def disk_of(path: Path) -> str:
    """``MAJOR:MINOR`` of the whole disk holding ``path`` (the throttle takes disks, not
    partitions)."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (node / "partition").exists():
        node = node.resolve().parent
    return (node / "dev").read_text().strip()


def slow_disk_missing() -> str | None:
    """Why writes cannot be limited here (None: they can)."""
    if os.geteuid() != 0:
        return "skipped: limiting a disk's writes needs root"
    if _BLKIO.is_dir() and os.access(_BLKIO, os.W_OK):
        return None
    if _UNIFIED is not None and "io" in (_UNIFIED / "cgroup.controllers").read_text().split():
        return None
    return "skipped: no cgroup block-I/O controller (blkio v1 or io v2) here"


@contextmanager
def slow_disk(path: Path, write_bps: int) -> Iterator[list[str] | None]:
    """A control group whose writes to ``path``'s disk are held to ``write_bps`` bytes/s;
    yields the command prefix that starts a program inside it (None when ``write_bps``
    is 0: no limit). The group is removed afterwards, also on failure, once the
    processes started in it have ended."""
    if not write_bps:
        yield None
        return
    path.mkdir(parents=True, exist_ok=True)
    group = _make_group(disk_of(path), write_bps)
    try:
        yield ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh"]
    finally:
        _remove(group)


@contextmanager
def joined(path: Path, write_bps: int) -> Iterator[None]:
    """This whole process (every thread) inside a group as :func:`slow_disk` makes, for
    the block; back in its own group afterwards."""
    if not write_bps:
        yield
        return
    path.mkdir(parents=True, exist_ok=True)
    home = _own_group()
    group = _make_group(disk_of(path), write_bps)
    try:
        (group / "cgroup.procs").write_text(str(os.getpid()))
        yield
    finally:
        (home / "cgroup.procs").write_text(str(os.getpid()))
        _remove(group)


def _make_group(disk: str, write_bps: int) -> Path:
    name = f"gpufleet-slowdisk-{os.getpid()}-{time.monotonic_ns()}"
    if _BLKIO.is_dir():
        group = _BLKIO / name
        group.mkdir()
        (group / "blkio.throttle.write_bps_device").write_text(f"{disk} {write_bps}")
        return group
    if _UNIFIED is None:
        raise RuntimeError(slow_disk_missing())
    (_UNIFIED / "cgroup.subtree_control").write_text("+io")
    group = _UNIFIED / name
    group.mkdir()
    (group / "io.max").write_text(f"{disk} wbps={write_bps}")
    return group


def _own_group() -> Path:
    """This process's group in the hierarchy :func:`_make_group` uses."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        if (_BLKIO.is_dir() and "blkio" in controllers.split(",")) or \
                (not _BLKIO.is_dir() and controllers == ""):
            root = _BLKIO if _BLKIO.is_dir() else _UNIFIED
            assert root is not None
            return root / where.lstrip("/")
    return _BLKIO if _BLKIO.is_dir() else _UNIFIED  # type: ignore[return-value]


def _remove(group: Path) -> None:
    for _ in range(50):  # the last processes started in it may still be leaving
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
