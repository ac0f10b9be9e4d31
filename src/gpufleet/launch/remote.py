"""What ``gpufleet train --hosts`` runs on each node: a small guard around the node's
``gpufleet train`` that ends it, and everything it started, when the ssh session ends.

The launcher (:mod:`gpufleet.launch.ssh`) runs this file's source over ssh as
``PYTHON -c SOURCE``, so a node needs nothing but the interpreter. The guard reads one
JSON line from stdin (``{"argv": [...], "cwd": ..., "env": {...}, "grace_s": S}``: the
environment travels on stdin, never on a command line that ``ps`` shows), starts the
command in a process group of its own, and then obeys stdin:

- ``INT`` / ``TERM``: send SIGINT / SIGTERM to the command's process group (what a
  Ctrl-C or a scheduler's stop on that node would send);
- ``KILL``: SIGKILL the command and every process under it;
- end of input (the launcher or its connection is gone): SIGTERM, then after
  ``grace_s`` seconds SIGKILL to every process under it.

The guard is a child subreaper (Linux ``prctl``), so processes that left the command's
group or lost their parent (torch's agent starts each rank in a session of its own) stay
under it; when the command ends, whatever is left is killed. The guard exits with the
command's status (128 + N for a command killed by signal N).

Only the standard library is used: this file runs on nodes before anything is imported.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

_PR_SET_CHILD_SUBREAPER = 36
SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM}


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux); False where the kernel does not offer it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list[int]:
    """Pids of every live process under ``root`` (read from /proc; zombies are left out,
    they are dead already)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended while we looked
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(group: int, reap: bool = True) -> None:
    """SIGKILL process group ``group`` and every process under this one, until none is
    left (a dying parent may still fork), and with ``reap`` collect them (only where the
    command itself was collected already: this reaps any child)."""
    for _ in range(50):
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        pids = descendants(os.getpid())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if reap:
            _reap()
        if not pids:
            return
        time.sleep(0.05)


def _reap() -> None:
    """Collect adopted children that ended (they would stay zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class Guard:
    """The command of one node and what stops it."""

    def __init__(self, proc: subprocess.Popen, grace_s: float) -> None:
        self.proc, self.grace_s = proc, grace_s

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the command's process group."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def follow(self, stream) -> None:
        """Obey the control lines on ``stream`` until the command ends or input ends."""
        for line in stream:
            word = line.strip()
            if word in SIGNALS:
                self.signal(SIGNALS[word])
            elif word == "KILL":
                kill_tree(self.proc.pid, reap=False)  # main() collects the command
                return
        # End of input: nobody is left to stop the command, so stop it here.
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.proc.poll() is None:
                kill_tree(self.proc.pid, reap=False)


def main() -> int:
    spec = json.loads(sys.stdin.readline() or "{}")
    if not spec.get("argv"):
        print("gpufleet remote guard: no command on stdin (it is started by gpufleet "
              "train --hosts)", file=sys.stderr)
        return 2
    cwd = spec.get("cwd") or os.getcwd()
    if not os.path.isdir(cwd):
        print(f"gpufleet: the working directory {cwd} does not exist on this host: the "
              "nodes need the same directories (a shared file system, or the same "
              "checkout on each).", file=sys.stderr)
        return 2
    become_subreaper()
    # Signals to the guard go to the command. Set before it starts, so the command begins
    # with the default handlers even where this process inherited SIGINT ignored.
    guards: list[Guard] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: [g.signal(signum) for g in guards])
    env = {**os.environ, **spec.get("env", {})}
    try:
        proc = subprocess.Popen(spec["argv"], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as err:
        print(f"gpufleet: cannot start {spec['argv'][0]} on this host ({err}): the nodes "
              "need the same Python at the same path.", file=sys.stderr)
        return 127
    guard = Guard(proc, float(spec.get("grace_s", 30.0)))
    guards.append(guard)
    threading.Thread(target=guard.follow, args=(sys.stdin,), daemon=True).start()
    code = proc.wait()
    kill_tree(proc.pid)  # what the command left behind
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
