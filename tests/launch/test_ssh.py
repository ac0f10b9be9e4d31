"""The one-shell launcher of ``gpufleet train --hosts``: each node's command, the flags it
refuses, and how it supervises the nodes (output prefixed by host, the first failure's
status, the others stopped, Ctrl-C passed on). Here a stand-in for ssh runs each node's
command on this machine; tests/cluster/test_ssh_hosts.py runs real sshd on the bed."""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from gpufleet import cli
from gpufleet.errors import ConfigError, LaunchError
from gpufleet.launch import ssh
from gpufleet.launch.hosts import Host

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the node guard reads /proc")

# Runs the command (ssh's last argument) here, after noting how it was called.
FAKE_SSH = """#!/bin/sh
for last; do :; done
echo "$@" | head -c 200 >> "{log}"; echo >> "{log}"
case "$*" in *" -- down "*) echo "ssh: connect to host down: No route" >&2; exit 255;; esac
exec sh -c "$last"
"""


@pytest.fixture
def fake_ssh(tmp_path: Path) -> tuple[str, ...]:
    path = tmp_path / "fakessh"
    path.write_text(FAKE_SSH.format(log=tmp_path / "ssh-calls.log"))
    path.chmod(0o755)
    return (str(path), *ssh.SSH_OPTS)


def _args(**kw) -> argparse.Namespace:
    base = {"hosts": "n1,n2", "hostfile": None, "env": [], "ssh_opts": "", "stop_grace": 30.0}
    return argparse.Namespace(**{**base, **kw})


def _job(fake_ssh, tmp_path, script: str, hosts=("a", "b"), **kw) -> ssh.HostJob:
    """Nodes that run ``sh -c script`` with the node's arguments (``$6``: its rank)."""
    return ssh.HostJob(hosts=tuple(Host(h) for h in hosts), train_args=("--max-steps", "3"),
                       ssh=fake_ssh, cwd=str(tmp_path), master_addr=hosts[0],
                       master_port=1234, program=("sh", "-c", script, "node"), **kw)


def _run(job: ssh.HostJob) -> tuple[int, str, str]:
    out, err = io.BytesIO(), io.BytesIO()
    code = ssh.run_hosts(job, out, err)
    return code, out.getvalue().decode(), err.getvalue().decode()


def test_every_node_gets_the_same_command_and_its_own_rank(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("n1 slots=2\nroot@n2 slots=1\n")
    job = ssh.job_from_args(_args(hosts=None, hostfile=str(path), env=["A=1"],
                                  ssh_opts="-F '/my dir/cfg'"),
                            ["--max-steps", "5", "--master-port=29555"],
                            {"NCCL_DEBUG": "WARN", "RANK": "4"})
    assert job.node_args(1, 0)[:4] == ["--max-steps", "5", "--master-port=29555", "--rdzv-id"]
    assert job.node_args(1, 0)[5:] == ["--nnodes", "2", "--node-rank", "1", "--master-addr",
                                       "n1", "--nproc", "1"]
    assert job.master_port == 29555 and job.hosts[1].label == "n2"
    spec = job.node_spec(0, 29555)
    assert spec["argv"][:4] == [sys.executable, "-m", "gpufleet", "train"]
    assert spec["argv"][-2:] == ["--nproc", "2"] and spec["cwd"] == os.getcwd()
    assert spec["env"] == {"NCCL_DEBUG": "WARN", "A": "1", ssh.NODE_ENV: "n1"}
    argv = job.ssh_argv(1, ["echo", "a b"])
    assert argv == ["ssh", "-o", "BatchMode=yes", "-F", "/my dir/cfg", "--", "root@n2",
                    "echo 'a b'"]


def test_a_run_directory_given_is_kept_and_the_master_address_may_be_named():
    job = ssh.job_from_args(_args(), ["--run-dir", "runs/x", "--master-addr", "10.0.0.1"], {})
    assert job.node_args(0, 7) == ["--run-dir", "runs/x", "--master-addr", "10.0.0.1",
                                   "--nnodes", "2", "--node-rank", "0", "--master-port", "7"]
    assert job.master_addr == "10.0.0.1"


@pytest.mark.parametrize(("kw", "train_args", "words"), [
    ({}, ["--nnodes", "2"], "--nnodes is set for each host"),
    ({}, ["--dist.node_rank=1"], "--node-rank is set for each host"),
    ({}, ["--rdzv-endpoint", "h:1"], "--rdzv-endpoint is set for each host"),
    ({"stop_grace": 0.0}, [], "--stop-grace 0"),
    ({"ssh_opts": "-F 'unclosed"}, [], "--ssh-opts"),
    ({"env": ["UNSET_HERE_X"]}, [], "UNSET_HERE_X is not set here"),
])
def test_flags_the_launcher_sets_are_refused(kw, train_args, words):
    with pytest.raises(ConfigError, match=words):
        ssh.job_from_args(_args(**kw), train_args, {})


def test_slots_and_nproc_together_are_refused(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("n1 slots=2\n")
    with pytest.raises(ConfigError, match="Drop --nproc"):
        ssh.job_from_args(_args(hosts=None, hostfile=str(path)), ["--nproc", "2"], {})


def test_output_is_prefixed_by_host_and_success_is_zero(fake_ssh, tmp_path):
    script = 'echo "args: $*"; echo "warn $GF_SENT" >&2; printf "no newline"'
    code, out, err = _run(_job(fake_ssh, tmp_path, script, env={"GF_SENT": "yes"}))
    assert code == 0, (out, err)
    assert "[a] args: --max-steps 3 --nnodes 2 --node-rank 0 --master-addr a " \
           "--master-port 1234\n" in out
    assert "[b] args: --max-steps 3 --nnodes 2 --node-rank 1 --master-addr a " \
           "--master-port 1234\n" in out
    assert "[a] no newline\n" in out and "[b] no newline\n" in out
    assert "[a] warn yes\n" in err and "[b] warn yes\n" in err
    calls = (tmp_path / "ssh-calls.log").read_text()
    assert "BatchMode=yes -- a " in calls and "BatchMode=yes -- b " in calls


def test_first_failure_is_the_status_and_the_others_are_stopped(fake_ssh, tmp_path):
    # Node a stops on SIGTERM; node b fails once a is running.
    script = ('if [ "$6" = 0 ]; then trap "echo stopped by TERM; exit 143" TERM; '
              "touch ready; while :; do sleep 0.1; done; fi; "
              "while [ ! -e ready ]; do sleep 0.05; done; echo failing; exit 7")
    code, out, _ = _run(_job(fake_ssh, tmp_path, script))
    assert code == 7
    assert "[b] failing" in out and "[a] stopped by TERM" in out


def test_a_node_deaf_to_sigterm_is_killed_after_the_grace(fake_ssh, tmp_path, caplog):
    script = ('if [ "$6" = 0 ]; then trap "" TERM; echo $$ > a.pid; '
              "while :; do sleep 0.1; done; fi; "
              "while [ ! -e a.pid ]; do sleep 0.05; done; exit 3")
    with caplog.at_level("INFO", logger=ssh.__name__):
        code, _, _ = _run(_job(fake_ssh, tmp_path, script, stop_grace_s=0.5))
    assert code == 3
    assert "killing a: still running 0.5 s after SIGTERM" in caplog.text
    assert "b failed first, with exit status 3" in caplog.text
    assert not Path(f"/proc/{(tmp_path / 'a.pid').read_text().strip()}").exists()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers are set in the main thread only")
def test_ctrl_c_reaches_every_node(fake_ssh, tmp_path):
    script = ('trap "echo got INT; exit 130" INT; touch ready$6; '
              "while :; do sleep 0.1; done")

    def press_ctrl_c() -> None:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{i}").exists() for i in (0, 1)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    code, out, _ = _run(_job(fake_ssh, tmp_path, script))
    assert code == 130
    assert "[a] got INT" in out and "[b] got INT" in out


def test_an_unreachable_host_fails_the_job_and_stops_the_rest(fake_ssh, tmp_path, caplog):
    script = "trap 'exit 143' TERM; while :; do sleep 0.1; done"
    with caplog.at_level("INFO", logger=ssh.__name__):
        code, _, err = _run(_job(fake_ssh, tmp_path, script, hosts=("a", "down")))
    assert code == ssh.SSH_FAILED
    assert "[down] ssh: connect to host down" in err
    assert "down failed first, with exit status 255 (ssh could not connect" in caplog.text


def test_the_master_port_is_asked_of_the_first_host(fake_ssh, tmp_path):
    port = ssh.free_port_on(_job(fake_ssh, tmp_path, "true"), 0)
    assert 0 < port < 65536
    with pytest.raises(LaunchError, match="without a password prompt"):
        ssh.free_port_on(_job(fake_ssh, tmp_path, "true", hosts=("down", "a")), 0)


def test_cli_checks_the_train_flags_before_any_ssh(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no ssh could run at all
    assert cli.main(["train", "--hosts", "n1,n2", "--model.nope", "1"]) == 2
    assert "model.nope" in capsys.readouterr().err
    assert cli.main(["train", "--hosts", "n1,n2", "--nnodes", "2"]) == 2
    assert "--nnodes is set for each host" in capsys.readouterr().err
    assert cli.main(["train", "--env", "X"]) == 2
    assert "Add --hosts H1,H2" in capsys.readouterr().err
    monkeypatch.setenv(ssh.NODE_ENV, "n2")
    assert cli.main(["train", "--hosts", "n1,n2"]) == 2
    assert "this is node n2 of a --hosts job" in capsys.readouterr().err
