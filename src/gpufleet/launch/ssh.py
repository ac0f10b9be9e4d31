"""``gpufleet train --hosts h1,h2`` (or ``--hostfile FILE``): start every node of a job
over ssh from one shell.

Each node runs the same ``gpufleet train`` command with ``--nnodes N --node-rank I
--master-addr <first host> --master-port P`` (a static rendezvous on the first host; the
port is one that host finds free, unless ``--master-port`` is given), in the same working
directory, with the same Python interpreter (this one's path), and with the environment
variables of :mod:`gpufleet.launch.hosts`'s allow-list plus ``--env NAME``. A hostfile's
``slots=N`` becomes that node's ``--nproc N``.

The system ``ssh`` client starts :mod:`gpufleet.launch.remote` on each node, a guard that
ends the node's processes when the ssh session ends; the command and the environment go
to it on stdin. Every line a node prints comes back prefixed ``[host] ``. A Ctrl-C here
is passed to every node as SIGINT (the ranks finish their step, write a checkpoint and
exit 130; a second Ctrl-C kills them), SIGTERM as SIGTERM. When a node fails, the others
get SIGTERM and, ``--stop-grace`` seconds later, SIGKILL. The job's exit status is the
first failure's (0 when every node succeeds).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gpufleet.errors import ConfigError, LaunchError
from gpufleet.launch import remote
from gpufleet.launch.hosts import Host, forwarded_env, parse_hosts, read_hostfile

logger = logging.getLogger(__name__)

# Set in each node's environment: a node's `gpufleet train` must never start hosts again.
NODE_ENV = "GPUFLEET_HOSTS_NODE"
SSH_OPTS = ("-o", "BatchMode=yes")  # fail at once where ssh would ask for a password
SSH_FAILED = 255  # ssh's own exit status: it could not connect or log in
_KILL_WAIT_S = 10.0  # after SIGKILL, how long a node's ssh session has to end

_NODE_FLAGS = {  # flags the launcher sets for each node: the user may not
    "--nnodes": "--dist.nnodes", "--node-rank": "--dist.node_rank",
    "--rdzv-endpoint": "--dist.rdzv_endpoint"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the multi-host flags to ``gpufleet train``'s parser."""
    group = parser.add_argument_group(
        "one shell, many hosts (ssh)",
        "start the same command on every host over ssh (see the multi-host guide)")
    group.add_argument("--hosts", metavar="H1,H2", help="hosts to run on; the first is "
                       "the master (node 0)")
    group.add_argument("--hostfile", metavar="FILE", help="hosts, one `HOST slots=N` a "
                       "line (slots: ranks on that host)")
    group.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                       help="also send this variable to every host (repeat for more)")
    group.add_argument("--ssh-opts", default="", metavar="'OPTS'",
                       help="extra ssh options, e.g. --ssh-opts='-F cluster_ssh_config'")
    group.add_argument("--stop-grace", type=float, default=30.0, metavar="S",
                       help="seconds the other hosts have to stop after one fails, "
                            "before they are killed (default 30)")


def wants_hosts(args: argparse.Namespace) -> bool:
    """Whether ``gpufleet train`` was asked to start hosts (and may: not on a node)."""
    if not (args.hosts or args.hostfile):
        if args.env or args.ssh_opts:
            raise ConfigError("--env and --ssh-opts only apply to a job started on "
                              "several hosts. Add --hosts H1,H2 or --hostfile FILE.")
        return False
    if os.environ.get(NODE_ENV):
        raise ConfigError(f"this is node {os.environ[NODE_ENV]} of a --hosts job, which "
                          "cannot start hosts again. Give --hosts only on the launching "
                          "machine.")
    if args.hosts and args.hostfile:
        raise ConfigError("give --hosts or --hostfile, not both.")
    return True


def host_flags() -> argparse.ArgumentParser:
    """A parser of the multi-host flags alone (to take them out of a command line)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return parser


@dataclass(frozen=True)
class HostJob:
    """Everything one shell needs to start a job on several hosts.

    Attributes:
        hosts: The nodes, node 0 (the master) first.
        train_args: ``gpufleet train``'s arguments, the same on every node.
        env: The variables every node gets.
        ssh: The ssh command and its options (the host and command follow).
        python: The interpreter the nodes run (this one's path).
        cwd: The working directory on every node.
        master_addr: Node 0's address as the nodes reach it.
        master_port: The rendezvous port on node 0 (0: node 0 picks a free one).
        stop_grace_s: Seconds between SIGTERM and SIGKILL when the job is stopped.
        program: What each node runs, before its arguments (``python -m gpufleet train``).
    """

    hosts: tuple[Host, ...]
    train_args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    ssh: tuple[str, ...] = ("ssh", *SSH_OPTS)
    python: str = sys.executable
    cwd: str = field(default_factory=os.getcwd)
    master_addr: str = ""
    master_port: int = 0
    stop_grace_s: float = 30.0
    program: tuple[str, ...] = (sys.executable, "-m", "gpufleet", "train")

    def node_args(self, i: int, port: int) -> list[str]:
        """``gpufleet train``'s arguments on node ``i``, the rendezvous on ``port``."""
        args = [*self.train_args, "--nnodes", str(len(self.hosts)), "--node-rank", str(i)]
        if not _given(self.train_args, "--master-addr", "--dist.master_addr"):
            args += ["--master-addr", self.master_addr]
        if not _given(self.train_args, "--master-port", "--dist.master_port"):
            args += ["--master-port", str(port)]
        if self.hosts[i].slots is not None:
            args += ["--nproc", str(self.hosts[i].slots)]
        return args

    def node_spec(self, i: int, port: int) -> dict[str, Any]:
        """What node ``i``'s guard is sent on stdin (see :mod:`gpufleet.launch.remote`)."""
        return {"argv": [*self.program, *self.node_args(i, port)],
                "cwd": self.cwd, "env": {**self.env, NODE_ENV: self.hosts[i].label},
                "grace_s": self.stop_grace_s}

    def ssh_argv(self, i: int, command: Sequence[str]) -> list[str]:
        """The local command that runs ``command`` on node ``i``."""
        return [*self.ssh, "--", self.hosts[i].name, " ".join(map(shlex.quote, command))]


def job_from_args(args: argparse.Namespace, train_args: Sequence[str],
                  environ: Mapping[str, str] = os.environ) -> HostJob:
    """The job the multi-host flags and ``gpufleet train``'s other arguments describe.

    Raises:
        ConfigError: bad hosts, a flag the launcher sets itself, an unset ``--env``.
    """
    hosts = read_hostfile(args.hostfile) if args.hostfile else parse_hosts(args.hosts)
    for flag, key in _NODE_FLAGS.items():
        if _given(train_args, flag, key):
            raise ConfigError(f"{flag} is set for each host by --hosts/--hostfile. Leave it "
                              "out; the nodes meet at the first host (--master-addr and "
                              "--master-port may be given).")
    if any(h.slots is not None for h in hosts) and _given(train_args, "--nproc", "--dist.nproc"):
        raise ConfigError("the hostfile gives each host its ranks (slots=N) and --nproc was "
                          "given too. Drop --nproc, or drop the slots from the hostfile.")
    if args.stop_grace <= 0:
        raise ConfigError(f"--stop-grace {args.stop_grace:g}: give a positive number of "
                          "seconds (default 30).")
    extra = list(train_args)
    if not _given(train_args, "--run-dir", "--run.dir", "--rdzv-id", "--dist.rdzv_id"):
        # The nodes must agree on one run directory: <out_dir>/<name>-<this id>.
        extra += ["--rdzv-id", time.strftime("%Y%m%d-%H%M%S")]
    port = _value(train_args, "--master-port", "--dist.master_port")
    try:
        ssh_opts = shlex.split(args.ssh_opts)
    except ValueError as err:
        raise ConfigError(f"--ssh-opts {args.ssh_opts!r}: {err}. Quote it as a shell "
                          "would, e.g. --ssh-opts='-F my_ssh_config'.") from err
    return HostJob(
        hosts=tuple(hosts), train_args=tuple(extra), env=forwarded_env(environ, args.env),
        ssh=("ssh", *SSH_OPTS, *ssh_opts),
        master_addr=(_value(train_args, "--master-addr", "--dist.master_addr")
                     or hosts[0].label),
        master_port=int(port) if port and port.isdigit() else 0,
        stop_grace_s=args.stop_grace)


def _given(args: Sequence[str], *flags: str) -> bool:
    return any(a in flags or a.split("=", 1)[0] in flags for a in args)


def _value(args: Sequence[str], *flags: str) -> str:
    """The last value given to any of ``flags`` (``--flag V`` or ``--flag=V``), or ''."""
    value = ""
    for i, arg in enumerate(args):
        name, sep, rest = arg.partition("=")
        if name in flags:
            value = rest if sep else (args[i + 1] if i + 1 < len(args) else "")
    return value


def free_port_on(job: HostJob, i: int = 0) -> int:
    """A TCP port free on node ``i`` right now, asked over ssh (which also shows that the
    node can be reached and runs the interpreter)."""
    probe = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
    argv = job.ssh_argv(i, [job.python, "-c", probe])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError as err:
        raise LaunchError("the ssh client is not installed here: install OpenSSH's client "
                          "(apt-get install openssh-client).") from err
    except subprocess.TimeoutExpired as err:
        raise LaunchError(f"`{shlex.join(argv[:-1])} ...` did not answer within 120 s: is "
                          f"{job.hosts[i].name} up and reachable?") from err
    if done.returncode != 0 or not done.stdout.strip().isdigit():
        raise LaunchError(
            f"could not run {job.python} on {job.hosts[i].name} over ssh (exit "
            f"{done.returncode}): {done.stderr.strip()[-2000:] or done.stdout.strip()}\n"
            + _ssh_hint(job, i, done.returncode))
    return int(done.stdout.strip())


def _ssh_hint(job: HostJob, i: int, code: int) -> str:
    if code == SSH_FAILED:
        return (f"`ssh {job.hosts[i].name} true` must work without a password prompt "
                "(batch mode): set up key login (ssh-copy-id) and accept the host key "
                "once, or pass the options it needs with --ssh-opts.")
    return (f"every host needs this interpreter ({job.python}) at the same path, with "
            "gpufleet installed, and the same working directory.")


@dataclass
class _Node:
    index: int
    host: Host
    proc: subprocess.Popen
    pumps: list[threading.Thread]

    def send(self, word: str) -> None:
        """Tell the node's guard INT, TERM or KILL (ignored once its session ended)."""
        try:
            self.proc.stdin.write(f"{word}\n".encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass


def run_hosts(job: HostJob, out: IO[bytes] | None = None,
              err: IO[bytes] | None = None) -> int:
    """Start the job on every host, relay signals, stop the others when one fails.

    Args:
        job: What to start where.
        out: Where the nodes' stdout lines go, prefixed ``[host] `` (default: stdout).
        err: Where their stderr lines go (default: stderr).

    Returns:
        The exit status of the first node that failed, 0 when none did.

    Example:
        >>> job = job_from_args(args, ["--max-steps", "100"])  # doctest: +SKIP
        >>> run_hosts(job)  # doctest: +SKIP
        0
    """
    out = out if out is not None else sys.stdout.buffer
    err = err if err is not None else sys.stderr.buffer
    port = job.master_port or free_port_on(job, 0)
    logger.info("starting %d node(s) over ssh, meeting at %s:%d: %s", len(job.hosts),
                job.master_addr, port, ", ".join(f"{h.label} (node {i}"
                                                 f"{f', {h.slots} ranks' if h.slots else ''})"
                                                 for i, h in enumerate(job.hosts)))
    signals: list[int] = []
    previous = _catch_signals(signals)
    done: queue.Queue = queue.Queue()
    lock = threading.Lock()
    nodes: list[_Node] = []
    try:
        for i in range(len(job.hosts)):
            nodes.append(_start(job, i, port, out, err, lock, done))
        return _supervise(nodes, done, signals, job.stop_grace_s)
    finally:
        for node in nodes:  # only left running when this process itself fails
            if node.proc.poll() is None:
                node.proc.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _catch_signals(signals: list[int]) -> dict[int, Any]:
    """Note SIGINT, SIGTERM and SIGHUP for the supervising loop (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, lambda signum, _frame: signals.append(signum))
    return previous


def _start(job: HostJob, i: int, port: int, out: IO[bytes], err: IO[bytes],
           lock: threading.Lock, done: queue.Queue) -> _Node:
    """Start node ``i``: ssh runs the guard, which is sent the node's command."""
    command = [job.python, "-c", Path(remote.__file__).read_text()]
    # A session of its own: a Ctrl-C in this terminal reaches this process only, which
    # passes it on through the guard (ssh would otherwise just drop the connection).
    proc = subprocess.Popen(job.ssh_argv(i, command), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    prefix = f"[{job.hosts[i].label}] ".encode()
    pumps = [threading.Thread(target=_pump, args=(stream, sink, prefix, lock), daemon=True)
             for stream, sink in ((proc.stdout, out), (proc.stderr, err))]
    node = _Node(i, job.hosts[i], proc, pumps)
    node.send(json.dumps(job.node_spec(i, port)))
    for pump in pumps:
        pump.start()
    threading.Thread(target=_wait, args=(node, done), daemon=True).start()
    return node


def _pump(stream: IO[bytes], sink: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``sink`` a line at a time, each line after ``prefix``."""
    for line in iter(stream.readline, b""):
        with lock:
            try:
                sink.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
                sink.flush()
            except (OSError, ValueError):  # our own output is gone: keep draining
                pass
    stream.close()


def _wait(node: _Node, done: queue.Queue) -> None:
    code = node.proc.wait()
    for pump in node.pumps:  # every line printed before the node counts as ended
        pump.join()
    done.put((node.index, code))


def _supervise(nodes: list[_Node], done: queue.Queue, signals: list[int],
               grace_s: float) -> int:
    """Wait for every node; pass signals on; stop the others after a failure."""
    first: tuple[_Node, int] | None = None
    running = {node.index for node in nodes}
    interrupts, term_at, kill_at = 0, None, None
    stop_asked = False  # a signal was passed on: every node is stopping already

    def tell(word: str) -> None:
        for i in running:
            nodes[i].send(word)

    while running:
        while signals:
            sig = signals.pop(0)
            interrupts += sig == signal.SIGINT
            word = {signal.SIGINT: "INT" if interrupts < 2 else "KILL"}.get(sig, "TERM")
            logger.warning("%s: passed to every node as %s%s", signal.Signals(sig).name,
                           "SIGKILL" if word == "KILL" else f"SIG{word}",
                           " (the ranks finish their step and write a checkpoint; Ctrl-C "
                           "again kills them)" if word == "INT" else "")
            tell(word)
            stop_asked = True
            if word == "KILL":
                kill_at = kill_at or time.monotonic()
        try:
            i, code = done.get(timeout=0.2)
        except queue.Empty:
            pass
        else:
            running.discard(i)
            if code != 0 and first is None:
                first = (nodes[i], code)
                if running and not stop_asked:
                    logger.error("%s failed (exit %d)%s; stopping the other node(s): "
                                 "SIGTERM, SIGKILL %g s later", nodes[i].host.label, code,
                                 _code_note(code), grace_s)
                    tell("TERM")
                    term_at = time.monotonic()
        now = time.monotonic()
        if term_at is not None and kill_at is None and now - term_at > grace_s:
            logger.error("killing %s: still running %g s after SIGTERM",
                         ", ".join(nodes[i].host.label for i in sorted(running)), grace_s)
            tell("KILL")
            kill_at = now
        if kill_at is not None and now - kill_at > _KILL_WAIT_S:
            for i in running:  # the guard did not answer: drop the connection
                nodes[i].proc.kill()
    if first is None:
        return 0
    node, code = first
    if stop_asked:
        logger.warning("the job stopped on a signal; %s ended first, with exit status %d%s",
                       node.host.label, code, _code_note(code))
    else:
        logger.error("the job failed: %s failed first, with exit status %d%s",
                     node.host.label, code, _code_note(code))
    return code


def _code_note(code: int) -> str:
    if code == SSH_FAILED:
        return " (ssh could not connect or log in)"
    try:
        return f" ({signal.Signals(code - 128).name})" if code > 128 else ""
    except ValueError:  # not a signal's number
        return ""
