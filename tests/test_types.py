"""The type checker over the packages pyproject.toml's [tool.mypy] names, with zero errors.

mypy keeps its cache where [tool.mypy] says (~/.cache/gpufleet/mypy), one for every
clone on the machine: the first run on a machine reads torch's types (minutes), later
runs, in any clone, only check what changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# A cold run (no cache) reads torch's type information and takes minutes on a loaded
# 2-core machine; a warm one seconds.
@pytest.mark.timeout(1200)
def test_mypy_reports_no_errors() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1150)
    report = done.stdout + done.stderr
    assert done.returncode == 0, f"mypy found errors (exit {done.returncode}):\n{report}"
    assert "Success: no issues found" in report, report
