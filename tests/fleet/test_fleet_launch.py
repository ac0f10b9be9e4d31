"""Fleet(devices=2).launch(fn) in a process that is not a rank starts 2 ranks with
torch's elastic agent and returns rank 0's result."""

from __future__ import annotations

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
