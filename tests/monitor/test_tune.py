"""`gpufleet tune` and the diagnosis zoo: a finding's suggested change applied and
measured, for real (CPU, subprocess runs)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _env
from gpufleet.monitor.tune import apply_changes, long_enough, throughput

ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / "diagnosis_zoo.py"


def test_a_change_replaces_the_users_own_setting_and_its_short_flag():
    args = ["--batch-size", "2", "--data.num_workers=0", "--max-steps=40", "--lr", "0.1"]
    changed, env = apply_changes(args, {"data.batch_size": 8, "data.num_workers": 2,
                                        "env.OMP_NUM_THREADS": 1})
    assert changed == ["--max-steps=40", "--lr", "0.1", "--data.batch_size=8",
                       "--data.num_workers=2"]
    assert env == {"OMP_NUM_THREADS": "1"}
    # Spacing logs out to every 100 steps needs a run of three such intervals.
    assert long_enough(changed, {"log.every": 100})[-1] == "--run.max_steps=300"
    assert long_enough(changed, {"data.num_workers": 2}) == changed


def test_throughput_counts_samples_over_wall_time_between_the_first_and_last_log(tmp_path):
    lines = [{"kind": "train", "step": 5, "time": 100.0, "samples_per_s": 10.0,
              "step_time_s": 0.5},
             {"kind": "eval", "step": 5, "time": 101.0},
             {"kind": "train", "step": 10, "time": 104.0, "samples_per_s": 20.0,
              "step_time_s": 0.2}]  # 5 steps x 0.2 s x 20/s = 20 samples in 4 s of wall
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)))
    assert throughput(tmp_path) == pytest.approx(5.0)


@pytest.mark.slow  # two training runs in subprocesses; the zoo test below covers the loop
def test_tune_measures_the_change_an_input_bound_job_is_told_to_make(run_cli, tmp_path):
    proc = run_cli("tune", "--steps", "20", "--repeats", "1", "--out", "tuned",
                   "--model", "toyjob:make_model", "--model.loss",
                   "torch.nn.functional:mse_loss", "--data", "toyjob:make_slow_data",
                   "--data.kwargs={delay = 0.002}", "--data.num_workers=0",
                   "--batch-size", "8", "--log.every", "5", "--run.eval_every=0",
                   timeout=300)
    row = [line for line in proc.stdout.splitlines() if line.startswith("input-bound")]
    assert row and "--data.num_workers=2" in row[0] and row[0].endswith("x"), proc.stdout
    # Both runs happened and were measured from their own metrics.
    for run in ("base-0", "try0-0"):
        assert throughput(tmp_path / "tuned" / run) > 0


@pytest.mark.slow
def test_the_quick_zoo_names_every_slowdown_first(tmp_path):
    out = tmp_path / "zoo.json"
    subprocess.run([sys.executable, str(ZOO), "--quick", "--json", str(out), "--out",
                    str(tmp_path / "runs")], env=_env(), check=True, timeout=1200)
    rows = json.loads(out.read_text())
    quick = [s for s in _zoo().scenarios() if s.quick]  # every one the zoo calls quick
    assert len(rows) == len(quick) >= 5, rows
    assert all(r["correct"] is True for r in rows), rows
    assert all(r["speedup"] for r in rows if r["expected"] != "(none)"), rows


def _zoo():
    """benchmarks/diagnosis_zoo.py as a module (its scenarios), not run."""
    spec = importlib.util.spec_from_file_location("diagnosis_zoo", ZOO)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("diagnosis_zoo", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_the_zoo_names_an_input_bound_loader_and_measures_its_fix(tmp_path):
    out = tmp_path / "zoo.json"
    subprocess.run([sys.executable, str(ZOO), "--quick", "--only", "input-bound",
                    "--repeats", "1", "--json", str(out), "--out", str(tmp_path / "runs")],
                   env=_env(), check=True, timeout=600)
    [row] = json.loads(out.read_text())
    assert row["first"] == "input-bound" and row["correct"] is True, row
    assert row["fix"].startswith("--data.num_workers=") and row["speedup"] > 0, row
