"""Fleet(devices=2).launch(fn) in a process that is not a rank starts 2 ranks with
torch's elastic agent and returns rank 0's result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_launch_starts_the_ranks_and_returns_rank_0s_result(tmp_path):
    script = Path(__file__).with_name("launched_loop.py")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"result ('sent!', 0, 2, 4, {str(tmp_path / 'run')!r})" in done.stdout
    assert (tmp_path / "run" / "report.html").is_file()


_AFTER_LAUNCH = """
import os, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("signals", os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE"))
"""


@pytest.mark.slow
def test_launch_without_a_function_runs_the_script_on_each_rank(tmp_path):
    """Fabric's ``fabric.launch()`` in a plain ``python script.py``: the script runs
    again as each of the ranks (with its arguments); the parent runs none of the rest
    and exits when they end, its environment as it was (no elastic variables left)."""
    script = Path(__file__).with_name("relaunched_script.py")
    done = subprocess.run([sys.executable, "-c", _AFTER_LAUNCH, str(script), str(tmp_path),
                           "--lr", "0.1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["args"] == ["--lr", "0.1"]
    assert ranks[0]["step"] == 1
    assert "signals None" in done.stdout
