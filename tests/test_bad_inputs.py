"""Bad input from the command line: one clear paragraph, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import socket

import pytest


@pytest.mark.parametrize("args, words", [
    (["train", "--optim.lr=nan"], ["optim.lr = nan is not a finite number"]),
    (["train", "--optim.lr=inf"], ["optim.lr = inf is not a finite number"]),
    (["train", "--optim.weight_decay=-nan"], ["optim.weight_decay = nan"]),
    (["serve", "runs/x", "--port", "99999"], ["--port 99999 is not a TCP port"]),
    (["serve", "runs/x", "--port", "-1"], ["--port -1 is not a TCP port"]),
])
def test_bad_values_get_one_paragraph_and_exit_2(run_cli, args, words):
    proc = run_cli(*args, expect=2)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpufleet: error: "), proc.stderr
    for word in words:
        assert word in proc.stderr


@pytest.mark.parametrize("pid", [-1, 0, "12"])
def test_cleanup_never_acts_on_a_recorded_pid_that_is_not_a_process(run_cli, tmp_path, pid):
    procs = tmp_path / "run" / "procs"
    procs.mkdir(parents=True)
    (procs / f"{socket.gethostname()}-x.json").write_text(json.dumps(
        {"pid": pid, "role": "launcher", "rank": None, "host": socket.gethostname(),
         "create_time": 1.0, "cmdline": [], "started": ""}))
    proc = run_cli("cleanup", str(tmp_path / "run"))
    assert "Traceback" not in proc.stderr
    assert f"pid {pid!r} is not a process id" in proc.stderr
    assert "nothing to clean up" in proc.stdout
