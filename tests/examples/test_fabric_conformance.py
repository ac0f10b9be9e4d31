"""scripts/fabric_conformance.py: Fabric's names point at Fleet, failures get causes.

A checkout of our own making stands in for Lightning's (no Lightning test file lives in
this repository): one test that passes only when ``Fabric`` is ``Fleet``, one that
reaches into Fabric's private state, one that hits a deliberate refusal and one plain
difference.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fabric_conformance.py"

PROBE = '''
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.fabric import Fabric as DeepFabric

import gpufleet


def test_fabric_is_fleet():
    assert Fabric is gpufleet.Fleet and DeepFabric is gpufleet.Fleet
    fabric = Fabric(accelerator="cpu", devices=1)
    assert fabric.world_size == 1


def test_private_state():
    fabric = Fabric(accelerator="cpu", devices=1)
    assert fabric._launched


def test_refusal(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.save({"a": torch.zeros(1)}, tmp_path / "c.pt")
    fabric.load(tmp_path / "c.pt", weights_only=False)


def test_difference():
    Fabric(accelerator="cpu", devices=1)
    raise ValueError("not what Fabric does")


def test_no_fabric():
    assert 1 + 1 == 2
'''


def test_usage_error_names_the_checkout(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--lightning", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "no tests/tests_fabric there" in out.stderr and str(tmp_path) in out.stderr


@pytest.mark.slow
def test_counts_by_cause(tmp_path: Path) -> None:
    tests = tmp_path / "checkout" / "tests" / "tests_fabric"
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "test_probe.py").write_text(PROBE)
    table_path = tmp_path / "table.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "--lightning",
                          str(tmp_path / "checkout"), "--files", "test_probe.py",
                          "--json", str(table_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = json.loads(table_path.read_text())
    assert table["collected"] == 5 and table["ran_on_fleet"] == 4
    assert table["passed"] == 1 and table["failed"] == 3
    assert table["failed_by_cause"] == {"Lightning internals": 1, "deliberate refusal": 1,
                                        "difference": 1}
    assert table["differences"] == [["ValueError: not what Fabric does", 1]]
    assert table["without_fleet"] == {"passed": 1}
    assert "failed, difference: 1" in out.stdout
