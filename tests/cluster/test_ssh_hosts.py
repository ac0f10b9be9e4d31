"""``gpufleet train --hosts`` / ``--hostfile`` on the bed with a real sshd on every node
(tests/cluster/sshbed.py): one shell starts both nodes, their output comes back prefixed
by host, a failure or a Ctrl-C stops the job everywhere, and nothing is left running."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import tomllib

from .conftest import PYTHON, node_env
from .nodes import TOY, Node, train_records, wait

pytestmark = pytest.mark.timeout(300)


def _launch(sshd, tmp_path: Path, args: list[str], tag: str = "") -> Node:
    """``gpufleet train --ssh-opts='-F <the test's ssh_config>' ARGS`` on node 0."""
    log = tmp_path / f"launcher{tag}.log"
    with open(log, "w") as out:
        proc = sshd.bed.popen(0, [PYTHON, "-m", "gpufleet", "train",
                                  f"--ssh-opts=-F {sshd.config}", *TOY, *args],
                              env=node_env(), cwd=tmp_path, stdout=out,
                              stderr=subprocess.STDOUT)
    return Node(0, proc, log)


def _run_dir(tmp_path: Path) -> Path | None:
    found = [p for p in (tmp_path / "runs").glob("*") if (p / "config.toml").exists()]
    return found[0] if found else None


def _no_strays(sshd, launcher: Node) -> None:
    """Every node is back to its sshd alone (sessions take a moment to close)."""
    deadline = time.monotonic() + 60
    while True:
        left = {name: sshd.strays(i) for i, name in enumerate(sshd.names)}
        left[sshd.names[0]] = [p for p in left[sshd.names[0]]
                               if not p.startswith(f"{launcher.proc.pid} ")]
        if not any(left.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"processes left on the nodes: {left}\n{launcher.output()[-4000:]}")
        time.sleep(0.3)


def test_two_hosts_train_from_one_shell_with_output_prefixed(sshd, tmp_path):
    launcher = _launch(sshd, tmp_path, ["--hosts", "n1,n2", "--data", "toyjob:make_data",
                                        "--max-steps", "4", "--batch-size", "16"])
    wait([launcher], timeout=240)
    out = launcher.output()
    run = _run_dir(tmp_path)
    assert run is not None, out[-4000:]
    dist = tomllib.loads((run / "config.toml").read_text())["dist"]
    assert (dist["nnodes"], dist["master_addr"], dist["nproc"]) == ("2", "n1", 1), out[-4000:]
    assert len(train_records(run)) == 4, out[-4000:]
    assert "[n1] " in out and "[n2] " in out, out[-4000:]
    _no_strays(sshd, launcher)


@pytest.mark.slow
def test_a_failing_host_fails_the_job_and_the_other_is_stopped(sshd, tmp_path):
    # n2 cannot read its data, so it never joins; n1 would wait at the rendezvous for the
    # whole --dist.rdzv_timeout (600 s here), but the launcher stops it at once.
    launcher = _launch(sshd, tmp_path, [
        "--hosts", "n1,n2", "--data", "toyjob:make_data_failing_on_host",
        "--max-steps", "4", "--dist.rdzv_timeout", "600", "--stop-grace", "20"])
    code = wait([launcher], timeout=240, expect=None)[0]
    out = launcher.output()
    assert code not in (0, 130), out[-4000:]
    assert "the training data is not on n2" in out, out[-4000:]
    assert f"n2 failed first, with exit status {code}" in out, out[-4000:]
    assert "n1 failed" not in out, out[-4000:]
    _no_strays(sshd, launcher)


def _until_training(launcher: Node, tmp_path: Path, steps: int) -> Path:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        run = _run_dir(tmp_path)
        if run is not None and len(train_records(run)) >= steps:
            return run
        assert launcher.proc.poll() is None, launcher.output()[-4000:]
        time.sleep(0.3)
    pytest.fail("no training steps within 180 s\n" + launcher.output()[-4000:])


LONG = ["--data", "toyjob:make_data", "--max-steps", "1000000", "--log.every", "10",
        "--batch-size", "16"]


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 75)])
def test_ctrl_c_stops_every_host_with_a_checkpoint_and_leaves_nothing(sshd, tmp_path, sig,
                                                                      status):
    # SIGINT: what Ctrl-C in the launcher's terminal sends; SIGTERM: a scheduler's stop.
    launcher = _launch(sshd, tmp_path, ["--hosts", "n1,n2", *LONG])
    run = _until_training(launcher, tmp_path, 2)
    launcher.proc.send_signal(sig)
    assert wait([launcher], timeout=180, expect=None) == [status], launcher.output()[-4000:]
    out = launcher.output()
    assert f"{sig.name}: passed to every node as {sig.name}" in out, out[-4000:]
    assert "the job stopped on a signal" in out and "failed" not in out, out[-4000:]
    saved = sorted((run / "checkpoints").glob("step-*"))
    assert saved, out[-4000:]
    _no_strays(sshd, launcher)
    # The same command, its run directory named, goes on from there.
    step = max(int(re.search(r"step-(\d+)", p.name)[1]) for p in saved)
    again = _launch(sshd, tmp_path, ["--hosts", "n1,n2", "--data", "toyjob:make_data",
                                     "--batch-size", "16", "--max-steps", str(step + 3),
                                     "--run-dir", str(run), "--resume", "latest"], "-again")
    wait([again], timeout=240)
    steps = [r["step"] for r in train_records(run)]
    assert steps[-3:] == [step + 1, step + 2, step + 3], again.output()[-4000:]
    _no_strays(sshd, again)


@pytest.mark.slow
def test_a_killed_launcher_leaves_nothing_on_the_hosts(sshd, tmp_path):
    # No signal to pass on: the ssh sessions end, and each node's guard stops its run.
    launcher = _launch(sshd, tmp_path, ["--hosts", "n1,n2", "--stop-grace", "5", *LONG])
    _until_training(launcher, tmp_path, 2)
    launcher.proc.kill()
    launcher.proc.wait(timeout=30)
    _no_strays(sshd, launcher)


@pytest.mark.slow
def test_hostfile_slots_set_the_ranks_of_each_host(sshd, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two ranks on n1, one on n2\nn1 slots=2\nn2 slots=1\n")
    launcher = _launch(sshd, tmp_path, ["--hostfile", str(hostfile), "--data",
                                        "toyjob:make_data", "--max-steps", "3",
                                        "--batch-size", "8", "--rdzv-id", "slots"])
    wait([launcher], timeout=240)
    run = tmp_path / "runs" / "make_model-make_data-slots"
    records = train_records(run)
    assert len(records) == 3, launcher.output()[-4000:]
    assert sorted(r["rank"] for r in records[-1]["rank_phases"]) == [0, 1, 2]
    assert "[n2] " in launcher.output()
    _no_strays(sshd, launcher)
