"""A real Slurm cluster on a network-namespace bed: munged, slurmctld and one slurmd per
node, all with their files in a temp dir of their own.

Each daemon runs in its node's network namespace, entered with ``nsenter --net`` and a
UTS and mount namespace of its own (``unshare``) for its host name and its /etc/hosts;
``ip netns exec`` remounts /sys and slurmd then refuses to start. Node ``i`` is named
``n{i+1}``; each node's hosts file maps its own name to 127.0.1.1, as Debian writes it,
and the other nodes to their bed addresses. The controller sits on the bridge (address
``.1``). The ports are the daemons' defaults: each listens in a namespace of its own, so
two beds never collide.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpufleet.bench.netbed import NetBed

TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "salloc", "sinfo", "scontrol",
         "nsenter", "unshare")
CONF_LINES = """ClusterName=gfbed
SlurmctldHost=ctl({ctl})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/slurmd-%n
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd-%n.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd-%n.log
"""


def slurm_missing() -> str | None:
    """Why a Slurm bed cannot start here (a tool is missing), or None."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"the Slurm bed needs {', '.join(missing)}: apt-get install slurm-wlm munge "
                "util-linux")
    return None


class SlurmBed:
    """Slurm daemons on the nodes of ``bed``; :meth:`close` stops every one of them."""

    def __init__(self, bed: NetBed, tmp: Path) -> None:
        self.bed, self.tmp = bed, tmp
        self.names = [f"n{i + 1}" for i in range(bed.nodes)]
        self.ctl = f"{bed.subnet}.1"
        self.conf = tmp / "slurm.conf"
        self._daemons: list[subprocess.Popen] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        tmp = self.tmp
        (tmp / "state").mkdir(parents=True)
        key = tmp / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = tmp / "munge.sock"
        self._daemons.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
             f"--pid-file={tmp}/munged.pid", f"--log-file={tmp}/munged.log",
             f"--seed-file={tmp}/munged.seed"], start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        self._wait(lambda: sock.exists(), 20, "munged's socket")
        nodes = "".join(f"NodeName={name} NodeAddr={self.bed.addr(i)} NodeHostname={name} "
                        "CPUs=2 State=UNKNOWN\n" for i, name in enumerate(self.names))
        self.conf.write_text(CONF_LINES.format(ctl=self.ctl, sock=sock, tmp=tmp) + nodes +
                             f"PartitionName=bed Nodes={','.join(self.names)} Default=YES "
                             "MaxTime=INFINITE State=UP\n")
        subprocess.run(["ip", "-n", self.bed.bridge_ns, "addr", "add", f"{self.ctl}/24",
                        "dev", "br0"], check=True)
        self._daemon(self.bed.bridge_ns, "ctl", f"slurmctld -D -i -f {self.conf}")
        for i, name in enumerate(self.names):
            self._daemon(self.bed.ns(i), name, f"slurmd -D -f {self.conf} -N {name}")
        self._wait(lambda: self._states() == {"idle"}, 60, "every node idle in sinfo")

    def _daemon(self, ns: str, name: str, command: str) -> None:
        """Start ``command`` in namespace ``ns`` under host name ``name``."""
        hosts = self.tmp / f"hosts-{name}"
        mine = "" if name == "ctl" else f"127.0.1.1\t{name}\n"  # Debian-style own name
        hosts.write_text(f"127.0.0.1\tlocalhost\n{mine}" + "".join(
            f"{self.bed.addr(i)}\t{other}\n" for i, other in enumerate(self.names)
            if other != name) + f"{self.ctl}\tctl\n")
        script = (f"mount --bind {hosts} /etc/hosts && hostname {name} && "
                  f"exec {command}")
        self._daemons.append(subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount",
             "--propagation", "private", "sh", "-c", script],
            start_new_session=True, stdout=open(self.tmp / f"{name}.out", "w"),
            stderr=subprocess.STDOUT))

    def _states(self) -> set[str]:
        out = self.client(0, ["sinfo", "-h", "-o", "%T"], timeout=20, check=False)
        return set(out.stdout.split()) if out.returncode == 0 else set()

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm bed: gave up waiting for {what} after {timeout:.0f} s\n"
                           + self.logs())

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a client command: SLURM_CONF set, no SLURM_* inherited."""
        from .conftest import node_env

        return node_env({"SLURM_CONF": str(self.conf), **(extra or {})})

    def client(self, node: int, argv: Sequence[str], timeout: float = 300,
               check: bool = True, env: Mapping[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm client (srun, sbatch, ...) on ``node``, wait, return its output."""
        proc = subprocess.run(["ip", "netns", "exec", self.bed.ns(node), *argv],
                              env=self.env(env), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            pytest.fail(f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
                        f"{proc.stderr[-4000:]}\n{self.logs()}")
        return proc

    def logs(self) -> str:
        """The tail of every daemon's log, for a failure message."""
        parts = []
        for path in sorted(self.tmp.glob("*.log")) + sorted(self.tmp.glob("*.out")):
            parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def close(self) -> None:
        """Stop every daemon this bed started (and what they started)."""
        for proc in reversed(self._daemons):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in reversed(self._daemons):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._daemons = []
