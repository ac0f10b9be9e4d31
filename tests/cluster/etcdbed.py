"""An etcd cluster on the network bed: one member per node, started the way a user
starts one (`gpufleet etcd`), always torn down."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.bench.netbed import NetBed
from gpufleet.launch.etcd_cluster import endpoints

from .conftest import PYTHON, node_env


def etcd_missing() -> str | None:
    """Why the bed cannot run an etcd cluster here (None: it can)."""
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        return "etcd is not installed (apt-get install etcd-server etcd-client)"
    try:
        import etcd  # noqa: F401  (python-etcd, the client the ranks use)
    except ModuleNotFoundError:
        return "python-etcd is not installed (pip install 'gpufleet[etcd]')"
    return None


class EtcdBed:
    """A member named ``m<i>`` on each of ``members`` (node indices) of ``bed``."""

    def __init__(self, bed: NetBed, folder: Path, members: list[int]) -> None:
        self.bed, self.folder, self.members = bed, folder, members
        self.cluster = {f"m{i}": bed.addr(i) for i in members}
        self.endpoint = endpoints(self.cluster)
        self.procs: dict[int, subprocess.Popen] = {}
        folder.mkdir(parents=True, exist_ok=True)
        try:
            for i in members:
                self.start(i)
            self.wait_healthy(members)
        except BaseException:
            self.close()
            raise

    def start(self, i: int) -> None:
        """Start member ``m<i>`` on node ``i`` (with its data folder, if it had one)."""
        cluster = ",".join(f"{n}={h}" for n, h in self.cluster.items())
        log = open(self.folder / f"m{i}.log", "a")
        with log:
            self.procs[i] = self.bed.popen(
                i, [PYTHON, "-m", "gpufleet", "etcd", "--name", f"m{i}", "--cluster", cluster,
                    "--data-dir", str(self.folder / f"m{i}")],
                env=node_env(), stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, members: list[int], timeout: float = 30.0) -> None:
        """Wait until every member of ``members`` answers as part of a healthy cluster."""
        urls = ",".join(f"{self.bed.addr(i)}:2379" for i in members)
        ask = members[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            probe = self.bed.popen(ask, ["etcdctl", "--endpoints", urls, "endpoint", "health"],
                                   env=node_env({"ETCDCTL_API": "3"}),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out, _ = probe.communicate(timeout=30)
            if probe.returncode == 0:
                return
            time.sleep(0.3)
        logs = "\n".join((self.folder / f"m{i}.log").read_text()[-2000:] for i in members)
        pytest.fail(f"the etcd cluster did not become healthy in {timeout:.0f} s: "
                    f"{out.decode(errors='replace')}\n{logs}")

    def close(self) -> None:
        """End every member this bed started (the bed's own teardown kills the rest)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
