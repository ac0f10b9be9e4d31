"""The one-call GPU check (scripts/gpu_check.sh, benchmarks/gpu_suite.py) keeps working
where there is no GPU: stage budgets and failures, the report's verdicts, and a dry run
of its quickest stages. The whole dry run is in the slow set."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


suite = _load("gpu_suite")
report = _load("gpu_report")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended


def test_a_failed_or_overlong_stage_is_recorded_and_the_next_one_runs(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    sleeper = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
               f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    stages = [
        suite.Stage("fails", 5, lambda ctx: [ctx.python, "-c", "import sys; sys.exit(3)"]),
        suite.Stage("sleeps", 2, lambda ctx: [ctx.python, "-c", sleeper]),
        suite.Stage("works", 10, lambda ctx: [ctx.python, "-c", "print('fine')"]),
    ]
    ctx = suite.Context(tmp_path, tmp_path, dry_run=True)
    seen = []
    outcomes = suite.run_suite(stages, ctx, budget_s=17,
                               on_stage=lambda o: seen.append(o[-1].name))
    assert [o.status for o in outcomes] == ["failed (exit 3)", outcomes[1].status, "passed"]
    assert outcomes[1].status.startswith("timed out after")
    assert outcomes[1].seconds < 30  # ended at its limit, not after its 60 s sleep
    assert not _alive(int(pid_file.read_text())), "the stage's child outlived it"
    assert seen == ["fails", "sleeps", "works"]
    assert "fine" in (tmp_path / "works.log").read_text()


def test_budgets_shrink_to_fit_and_a_stage_without_time_is_skipped(tmp_path):
    stages = [suite.Stage(n, 100, lambda ctx: [ctx.python, "-c", "pass"]) for n in "ab"]
    ctx = suite.Context(tmp_path, tmp_path, dry_run=True)
    outcomes = suite.run_suite(stages, ctx, budget_s=20)
    assert [o.status for o in outcomes] == ["passed", "passed"]
    assert 5 <= outcomes[0].timeout_s <= 10.5  # half of 20 s, the other half reserved
    late = suite.run_suite(stages, ctx, budget_s=0.5)
    assert all(o.status.startswith("not run") for o in late)


def _gpu_run() -> dict:
    """What a GPU run's results.json holds, with one target missed on purpose."""
    rows = [{"config": "fp32", "precision": "fp32", "compile": None, "step_s": 0.08,
             "tokens_per_s": 200_000.0, "mfu": 0.30, "peak_flops": 494.7e12,
             "peak_precision": "tf32", "hand_step_s": 0.0795, "ratio": 1.006},
            {"config": "bf16-mixed", "precision": "bf16-mixed", "compile": None,
             "step_s": 0.035, "tokens_per_s": 470_000.0, "mfu": 0.41, "peak_flops": 989e12,
             "peak_precision": "bf16", "hand_step_s": 0.034, "ratio": 1.03},
            {"config": "bf16-mixed + compile (default)", "precision": "bf16-mixed",
             "compile": "default", "step_s": 0.028, "tokens_per_s": 590_000.0, "mfu": 0.52,
             "peak_flops": 989e12, "peak_precision": "bf16", "hand_step_s": 0.028,
             "ratio": 1.0}]
    stages = [
        {"name": "tests", "status": "passed", "seconds": 80, "timeout_s": 170,
         "summary": {"counts": {"passed": 17}, "problems": [], "skips": []}},
        {"name": "mfu", "status": "passed", "seconds": 150, "timeout_s": 300,
         "summary": {"device": "NVIDIA H200", "shape": {"n_layer": 12}, "rows": rows,
                     "curves": {"fp32": [4.0, 3.0], "bf16-mixed": [4.0, 3.01],
                                "max_abs_diff": 0.01, "mean_abs_diff": 0.005}}},
        {"name": "monitor", "status": "timed out after 75 s", "seconds": 75,
         "timeout_s": 75, "summary": {}},
    ]
    machine = {"summary": "x", "torch": "2.9.0", "cuda": True, "gpus": ["NVIDIA H200"],
               "driver": "570.1", "date_utc": "today"}
    return {"machine": machine, "dry_run": False, "stages": stages}


def test_the_report_checks_every_target_it_has_numbers_for():
    text = report.render_markdown(_gpu_run())
    verdicts = {row[0]: row[2] for row in report.targets(
        {s["name"]: s["summary"] for s in _gpu_run()["stages"]})}
    assert verdicts["MFU bf16 + compile >= 50%"] == "met"
    assert verdicts["bf16 tokens/s >= 2x fp32"] == "met"  # 470k / 200k = 2.35
    assert verdicts["gpufleet / hand-written step time <= 1.02 (worst row)"] == "MISSED"
    assert not any(k.startswith("monitor") for k in verdicts)  # that stage timed out
    assert "| monitor | timed out after 75 s |" in text
    assert "| bf16-mixed + compile (default) | 28.00 | 590,000 | 52.0% |" in text
    assert "driver 570.1" in text and "17 passed" in text


def _run_dry(out: Path, *stages: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    args = ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)]
    if stages:
        args += ["--stages", ",".join(stages)]
    return subprocess.run(args, env={**env, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=600)


def test_dry_run_of_the_quick_stages(tmp_path):
    proc = _run_dry(tmp_path, "tests", "prefetch")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    stages = {s["name"]: s for s in data["stages"]}
    assert stages["tests"]["status"] == "passed" and stages["prefetch"]["status"] == "passed"
    counts = stages["tests"]["summary"]["counts"]
    assert counts.get("skipped", 0) >= 17 and not counts.get("failed")  # no CUDA here
    assert set(stages["prefetch"]["summary"]["summary"]) == {"on", "off"}
    text = (tmp_path / "results.md").read_text()
    assert "Dry run" in text and "| prefetch | passed |" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "prefetch.log", "results.json", "results.md", "tests.log"]


@pytest.mark.slow
def test_full_dry_run(tmp_path):
    proc = _run_dry(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    assert [s["status"] for s in data["stages"]] == ["passed"] * len(suite.STAGES), \
        data["stages"]
    assert len(list(tmp_path.iterdir())) <= 8


def test_the_new_paths_stage_runs_its_own_file_and_the_tests_stage_the_others(tmp_path):
    ctx = suite.Context(tmp_path, tmp_path, dry_run=True)
    stages = {s.name: s for s in suite.STAGES}
    new, old = stages["new_paths"].command(ctx), stages["tests"].command(ctx)
    assert suite.NEW_PATHS == "tests/gpu/test_cuda_new_paths.py" and suite.NEW_PATHS in new
    assert (REPO / suite.NEW_PATHS).is_file() and "mark.gpu" in (
        REPO / suite.NEW_PATHS).read_text()
    assert suite.NEW_PATHS not in old and "tests/gpu/test_cuda_training.py" in old
    assert ["-m", "gpu"] == new[new.index("-m", 2):new.index("-m", 2) + 2]
    # The first call of the split the docs give still fits one device call.
    first = "tests,new_paths,default_job,mfu,prefetch".split(",")
    assert sum(stages[n].budget_s for n in first) <= suite.CALL_S
    # Its log is read like the tests stage's.
    (tmp_path / "new_paths.log").write_text("SKIPPED [9] x: no CUDA\n9 skipped in 3.1s\n")
    summary = report.summarize("new_paths", ctx, "passed")
    assert summary["counts"] == {"skipped": 9}
    assert "This turn's CUDA paths" in report.render_markdown(
        {"machine": {"summary": "x", "torch": "t", "date_utc": "d"}, "dry_run": True,
         "stages": [{"name": "new_paths", "status": "passed", "seconds": 3,
                     "timeout_s": 9, "summary": summary}]})
