"""What a silent rank's process is doing, read from ``/proc`` on its own node.

A rank can stop answering for different reasons, each with its own fix: its process is
stopped (state ``T``: SIGSTOP, a debugger, job control) or stuck in the kernel (``D``:
uninterruptible I/O, a driver), it is dead, or its whole node is down or cut off. Only
a process on the same node can read the first three from ``/proc``; the liveness check
relays the answer through the job's store (:mod:`gpufleet.fault.liveness`).

Example:
    >>> import os
    >>> process_state(os.getpid()) in ("R", "S")
    True
    >>> process_state(2**22 + 1)  # no such process
    'gone'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: A state for a process that does not exist (dead, reaped) on the node that looked.
GONE = "gone"


def process_state(pid: int) -> str:
    """The ``/proc/<pid>/stat`` state letter of ``pid`` on this node (``R``, ``S``,
    ``D``, ``T``, ``t``, ``Z``, ...), or :data:`GONE` when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return GONE
    except OSError:  # no /proc here (not Linux): unknown, as if nobody looked
        return ""
    # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the
    # last closing parenthesis.
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0]


def state_words(state: str, pid: Any = "?", host: str = "?") -> str | None:
    """What a silent rank's process state means, or None when nobody on its node could
    look (its node is down or cut off)."""
    if state in ("T", "t"):
        return (f"its process (pid {pid} on {host}) is alive but stopped (state {state}: "
                "SIGSTOP, a debugger or job control); its node is up. `kill -CONT "
                f"{pid}` resumes it")
    if state == "D":
        return (f"its process (pid {pid} on {host}) is stuck in the kernel (state D: "
                "uninterruptible I/O, a file system or a driver); its node is up")
    if state in (GONE, "Z", "X"):
        return (f"its process (pid {pid} on {host}) is dead (it no longer runs); its "
                "node is up")
    if state:
        return (f"its process (pid {pid} on {host}) is alive (state {state}) but its "
                "heartbeats do not arrive: its heartbeat thread does not run (native code "
                "holds Python's interpreter lock, or the process is starved of CPU) or its "
                "connection to the store is cut")
    return None
