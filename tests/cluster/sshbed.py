"""Real OpenSSH servers on a network-namespace bed, and a client setup of the test's own.

Each node ``i`` (named ``n{i+1}``) runs ``sshd -D -e`` in its network namespace, entered
with ``nsenter --net``, and in a UTS and mount namespace of its own (``unshare``): its
host name, an /etc/hosts that maps every node's name to its bed address, and a private
/run for sshd's privilege-separation directory, so nothing on the host changes. Host
keys, authorized_keys and the sshd configs live in the test's temp dir; root logs in
with a key only. The client side is an ``ssh_config`` file (``-F``) naming the nodes,
the test's own key and known_hosts: the user's ~/.ssh is never read or written.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from gpufleet.bench.netbed import NetBed

TOOLS = ("sshd", "ssh", "ssh-keygen", "nsenter", "unshare", "mount")
SSHD_CONFIG = """ListenAddress {addr}
Port 22
HostKey {tmp}/host_ed25519
AuthorizedKeysFile {tmp}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
PidFile {tmp}/sshd-{name}.pid
LogLevel ERROR
"""
CLIENT_CONFIG = """Host *
  User root
  IdentityFile {tmp}/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile {tmp}/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  ConnectTimeout 30
  LogLevel ERROR
"""


def ssh_missing() -> str | None:
    """Why the ssh bed cannot start here (a tool is missing), or None."""
    missing = [tool for tool in TOOLS
               if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()]
    if missing:
        return (f"the ssh bed needs {', '.join(missing)}: apt-get install openssh-server "
                "openssh-client util-linux")
    return None


class SshBed:
    """An sshd on every node of ``bed``; :attr:`config` is the client's ``ssh -F`` file;
    :meth:`close` stops every sshd (the bed's own teardown kills what is left)."""

    def __init__(self, bed: NetBed, tmp: Path) -> None:
        self.bed, self.tmp = bed, tmp
        self.names = [f"n{i + 1}" for i in range(bed.nodes)]
        self.config = tmp / "ssh_config"
        self.daemons: list[subprocess.Popen] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        tmp = self.tmp
        tmp.mkdir(parents=True, exist_ok=True)
        for key in ("host_ed25519", "id_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gfbed-{key}",
                            "-f", str(tmp / key)], check=True, capture_output=True)
        (tmp / "authorized_keys").write_text((tmp / "id_ed25519.pub").read_text())
        host_key = " ".join((tmp / "host_ed25519.pub").read_text().split()[:2])
        known = ",".join([*self.names, *(self.bed.addr(i) for i in range(self.bed.nodes))])
        (tmp / "known_hosts").write_text(f"{known} {host_key}\n")
        self.config.write_text("".join(f"Host {name}\n  HostName {self.bed.addr(i)}\n"
                                       for i, name in enumerate(self.names))
                               + CLIENT_CONFIG.format(tmp=tmp))
        hosts = tmp / "hosts"
        hosts.write_text("127.0.0.1\tlocalhost\n" + "".join(
            f"{self.bed.addr(i)}\t{name}\n" for i, name in enumerate(self.names)))
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        for i, name in enumerate(self.names):
            conf = tmp / f"sshd-{name}.conf"
            conf.write_text(SSHD_CONFIG.format(addr=self.bed.addr(i), tmp=tmp, name=name))
            script = (f"mount --bind {hosts} /etc/hosts && hostname {name} && "
                      "mount -t tmpfs -o mode=755 gfbed-run /run && mkdir -m 755 /run/sshd && "
                      f"exec {sshd} -D -e -f {conf}")
            self.daemons.append(subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.bed.ns(i)}", "unshare", "--uts",
                 "--mount", "--propagation", "private", "sh", "-c", script],
                start_new_session=True, stdout=open(tmp / f"sshd-{name}.log", "w"),
                stderr=subprocess.STDOUT))
        for i in range(self.bed.nodes):
            self._wait_ready(i)

    def _wait_ready(self, i: int) -> None:
        deadline = time.monotonic() + 60
        while True:
            done = self.bed_run(0, ["ssh", "-F", str(self.config), "-o", "BatchMode=yes",
                                    self.names[i], "hostname"])
            if done.returncode == 0 and done.stdout.strip() == self.names[i]:
                return
            if time.monotonic() > deadline or self.daemons[i].poll() is not None:
                raise RuntimeError(f"sshd on {self.names[i]} did not answer: "
                                   f"{done.stderr.strip()}\n{self.logs()}")
            time.sleep(0.3)

    def bed_run(self, node: int, argv: list[str]) -> subprocess.CompletedProcess:
        """Run ``argv`` in node ``node``'s network namespace and wait for it."""
        return subprocess.run(["ip", "netns", "exec", self.bed.ns(node), *argv],
                              capture_output=True, text=True, timeout=120)

    def strays(self, node: int) -> list[str]:
        """Every process in node ``node``'s namespace but its sshd: ``pid command``."""
        listed = subprocess.run(["ip", "netns", "pids", self.bed.ns(node)],
                                capture_output=True, text=True).stdout.split()
        daemons = {d.pid for d in self.daemons}
        found = []
        for pid in map(int, listed):
            if pid in daemons:
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            found.append(f"{pid} {cmd.decode(errors='replace')[:160]}")
        return found

    def logs(self) -> str:
        """The sshd logs, for a failure message."""
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted(self.tmp.glob("sshd-*.log")))

    def close(self) -> None:
        """Stop every sshd this bed started."""
        for proc in self.daemons:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.daemons:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.daemons = []
