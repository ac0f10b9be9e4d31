"""The built-in GPT on its default data (the stdlib corpus), as ``gpufleet train`` runs
it with no ``--model`` or ``--data``, under every strategy preset and every composed
layout given by its degrees alone: one short run each, so a preset that breaks on the
default job (as ``pipeline`` did, asking the last stage for a loss the GPT computes in
its own forward) is seen in the default test run.

Each run must end with a training loss that went down, a finite evaluation loss and a
final checkpoint whose weights are finite; a layout given by degrees alone must have
taken the preset the plan decides for them. The GPT is made small by flags (2 blocks of
width 32 over 32 bytes); the data stay the default. Runs of 8 ranks keep one
representative in the default run (FSDP x TP x PP), the rest are ``slow``.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from conftest import _env
from gpufleet.parallel.horovod import horovod_available
from gpufleet.train.checkpoint import sharded

SMALL = ["--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32",
         "--model.block_size", "32", "--batch-size", "8", "--max-steps", "4",
         "--optim.warmup_steps", "1", "--log.every", "1", "--run.out_dir", "runs",
         "--monitor.report", "false", "--monitor.system_interval_s", "0",
         "--data.num_workers", "0", "--run.eval_batches", "2"]
CPU = ["--device", "cpu"]
needs_horovod = pytest.mark.skipif(
    not horovod_available(), reason="Horovod is not installed: scripts/install-horovod.sh")


def case(name: str, ranks: int, flags: list[str], strategy: str, *marks):
    """One run: its id, ranks, flags and the strategy the plan must record."""
    return pytest.param(name, ranks, flags, strategy, marks=marks, id=name)



def train_and_check(run_cli, tmp_path: Path, name: str, ranks: int, flags: list[str],
                    strategy: str) -> None:
    """Train the small default GPT under ``flags`` and check what the module says."""
    if strategy == "horovod":
        _horovodrun(tmp_path, ranks, *SMALL, *flags, "--run-dir", "runs/run")
    else:
        launch = ["--nproc", str(ranks)] if ranks > 1 else []
        run_cli("train", *launch, *flags, *SMALL, "--run-dir", "runs/run", timeout=280)
    run = tmp_path / "runs" / "run"
    recorded = tomllib.loads((run / "config.toml").read_text())["parallel"]
    assert recorded["strategy"] == strategy  # auto decided from the degrees, once
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    evals = [r["eval_loss"] for r in rows if r["kind"] == "eval"]
    assert len(losses) == 4 and all(map(math.isfinite, losses)), losses
    assert losses[-1] < losses[0], f"{name}: the loss did not go down: {losses}"
    assert evals and all(map(math.isfinite, evals)), evals
    weights = _final_weights(run)
    assert "lm_head.weight" in weights or "wte.weight" in weights
    for key, value in weights.items():
        assert torch.isfinite(value).all(), f"{name}: {key} is not finite"


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The model in the run's last checkpoint: one file, or a sharded step-N/ folder."""
    saved = [p for p in (run / "checkpoints").glob("step-*") if p.suffix != ".sha256"]
    (last,) = sorted(saved)[-1:]
    if last.is_dir():
        return sharded.read_full_model(last)
    return torch.load(last, map_location="cpu", weights_only=True)["model"]


def _horovodrun(tmp_path: Path, ranks: int, *args: str) -> None:
    """``horovodrun -np N -H localhost:N --gloo gpufleet train ...``, as a user would."""
    horovodrun = shutil.which("horovodrun") or str(Path(sys.executable).parent / "horovodrun")
    command = [horovodrun, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
               "--start-timeout", "120", sys.executable, "-m", "gpufleet", "train", *args]
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=280)
    if proc.returncode != 0:
        pytest.fail(f"horovodrun exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-6000:]}"
                    f"\nSTDERR:\n{proc.stderr[-6000:]}")
