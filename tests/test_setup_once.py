"""Every process of a run names the run, joins the process group, seeds and sets up
logging at most once, on every path: one-process fit, `gpufleet train`, and a fit that
starts two ranks; and `gpufleet train --nproc 2` builds the model and data once per
process: each rank its own (a factory may build differently on each rank), the launcher
once for the preflight."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import setupcalls
import toyjob
from gpufleet.cli import main

HERE = Path(__file__).parent
BASE = {"run.max_steps": 2, "log.progress": "off", "data.batch_size": 32,
        "data.num_workers": 0}


@pytest.fixture
def call_log(tmp_path, monkeypatch):
    """The counters installed in this process and in any rank it starts."""
    log = tmp_path / "calls.log"
    monkeypatch.setenv(setupcalls.LOG_ENV, str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    setupcalls.install(monkeypatch.setattr)
    return log


def _at_most_once(per_process):
    for pid, counts in per_process.items():
        assert max(counts.values()) == 1, f"process {pid} repeated a setup call: {counts}"


def test_one_process_fit(tmp_path, call_log):
    torch.manual_seed(0)
    result = gpufleet.fit(setupcalls.Model(), toyjob.make_data(), loss_fn=F.mse_loss,
                          overrides={**BASE, "run.out_dir": str(tmp_path)})
    assert result.steps == 2
    [counts] = setupcalls.calls(call_log).values()
    _at_most_once({0: counts})
    # Logging: fit leaves a setup of the user's (here pytest's) alone.
    assert {"named", "join_process_group", "seed_everything"} <= set(counts)


def test_the_cli(tmp_path, call_log):
    code = main(["train", "--model", "toyjob:make_model", "--data", "toyjob:make_data",
                 "--model.loss", "torch.nn.functional:mse_loss", f"--run.out_dir={tmp_path}",
                 *(f"--{k}={v}" for k, v in BASE.items())])
    assert code == 0
    [counts] = setupcalls.calls(call_log).values()
    assert counts == {"named": 1, "join_process_group": 1, "seed_everything": 1,
                      "setup_logging": 1}


def test_a_fit_that_starts_two_ranks(tmp_path, call_log):
    result = gpufleet.fit(setupcalls.Model(), toyjob.make_data(), loss_fn=F.mse_loss,
                          overrides={**BASE, "run.out_dir": str(tmp_path), "dist.nproc": 2,
                                     "run.preflight": False})
    assert result.steps == 2
    per_process = setupcalls.calls(call_log)
    _at_most_once(per_process)
    launcher = per_process.pop(os.getpid())
    assert launcher == {"named": 1}  # the plan is made here, once, and sent
    assert len(per_process) == 2, per_process  # the two ranks, each in its own process
    for counts in per_process.values():
        assert counts == {"join_process_group": 1, "seed_everything": 1, "setup_logging": 1}


# With the preflight (the default) in the slow set: without it is the default run's case.
@pytest.mark.parametrize("preflight", [pytest.param(True, marks=pytest.mark.slow), False])
def test_train_on_two_ranks_builds_the_job_once_per_process(tmp_path, call_log, preflight):
    code = main(["train", "--nproc", "2", "--model", "setupcalls:counted_model",
                 "--data", "setupcalls:counted_data", "--model.loss",
                 "torch.nn.functional:mse_loss", f"--run.out_dir={tmp_path}",
                 f"--run.preflight={str(preflight).lower()}",
                 *(f"--{k}={v}" for k, v in BASE.items())])
    assert code == 0
    builds = {pid: {k: v for k, v in counts.items() if k.startswith("build_")}
              for pid, counts in setupcalls.calls(call_log).items()}
    builds = {pid: counts for pid, counts in builds.items() if counts}
    once = {"build_model": 1, "build_data": 1}
    assert builds.pop(os.getpid(), None) == (once if preflight else None)
    assert len(builds) == 2 and all(counts == once for counts in builds.values()), builds
