"""A rank the elastic agent starts as ``python -m gpufleet.launch.rankmain PAYLOAD``: it
runs the pickled call, imports nothing of the agent, hands its result back in a file,
and leaves a failure's traceback in the agent's error file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

from gpufleet.launch import rankmain

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _launch_workers as workers  # noqa: E402

AGENT = "torch.distributed.elastic.agent.server.api"


def _start(payload: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *rankmain.COMMAND, str(payload)], stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(HERE), os.environ.get("PYTHONPATH")])), **env})


def test_a_rank_runs_the_call_and_hands_back_its_result_or_its_error(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    names = [AGENT, "torch", "_launch_workers"]
    ok = _start(rankmain.write_payload(good, workers.loaded, (names,)), RANK="3")
    error_file = tmp_path / "error.json"
    failed = _start(rankmain.write_payload(bad, workers.raise_value_error, ()), RANK="0",
                    TORCHELASTIC_ERROR_FILE=str(error_file))
    assert ok.wait(timeout=120) == 0, ok.stderr.read()
    assert rankmain.read_results(good) == {3: {AGENT: False, "torch": True,
                                               "_launch_workers": True}}
    assert failed.wait(timeout=120) == 1
    assert "bad value on purpose" not in failed.stderr.read()  # the launcher says it once
    assert rankmain.read_results(bad) == {}
    message = json.loads(error_file.read_text())["message"]
    assert "ValueError: bad value on purpose" in message["message"]


def test_the_gpufleet_command_is_not_run_again_in_its_ranks(monkeypatch):
    """A rank of a script imports the script (what it sends may be defined there); a
    rank of the `gpufleet` console script has nothing to import from it."""
    script = types.ModuleType("__main__")
    script.__file__ = "/home/user/train.py"
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert rankmain._preparation()["init_main_from_path"] == "/home/user/train.py"
    from gpufleet.cli import main

    command = types.ModuleType("__main__")
    command.__file__, command.main = "/usr/local/bin/gpufleet", main
    monkeypatch.setitem(sys.modules, "__main__", command)
    prepared = rankmain._preparation()
    assert "init_main_from_path" not in prepared and "init_main_from_name" not in prepared
    assert prepared["sys_path"] and prepared["dir"] == os.getcwd()


def test_a_rank_its_node_started_before_counts_as_a_restart(monkeypatch):
    """torch counts only failed attempts; a restart for a node that joined resumes too."""
    monkeypatch.delenv(rankmain.RESTARTED, raising=False)
    assert rankmain.restarts(0) == 0 and rankmain.restarts(2) == 2
    monkeypatch.setenv(rankmain.RESTARTED, "1")
    assert rankmain.restarts(0) == 1 and rankmain.restarts(2) == 2
