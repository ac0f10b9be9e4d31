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
from gpufleet.parallel import strategy_names
from gpufleet.parallel.horovod import horovod_available
from gpufleet.train.checkpoint import sharded

SMALL = ["--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32",
         "--model.block_size", "32", "--batch-size", "8", "--max-steps", "4",
         "--optim.warmup_steps", "1", "--log.every", "1", "--run.out_dir", "runs",
         "--monitor.report", "false", "--monitor.system_interval_s", "0",
         "--data.num_workers", "0"]
CPU = ["--device", "cpu"]
needs_horovod = pytest.mark.skipif(
    not horovod_available(), reason="Horovod is not installed: scripts/install-horovod.sh")


def _case(name: str, ranks: int, flags: list[str], strategy: str, *marks):
    """One run: its id, ranks, flags and the strategy the plan must record."""
    return pytest.param(name, ranks, flags, strategy, marks=marks, id=name)


PRESETS = [
    _case("single", 1, ["--strategy", "single", *CPU], "single"),
    _case("dp", 1, ["--strategy", "dp", "--device", "cuda"], "dp", pytest.mark.gpu),
    _case("ddp", 2, ["--strategy", "ddp", *CPU], "ddp"),
    _case("fsdp", 2, ["--strategy", "fsdp", *CPU], "fsdp"),
    _case("hsdp", 2, ["--strategy", "hsdp", *CPU], "hsdp"),
    _case("zero1", 2, ["--strategy", "zero1", *CPU], "zero1"),
    _case("pipeline", 2, ["--strategy", "pipeline", *CPU], "pipeline"),
    _case("local_sgd", 2, ["--strategy", "local_sgd", "--parallel.local_sgd.warmup_steps", "2",
                           "--parallel.local_sgd.period", "1", *CPU], "local_sgd"),
    _case("model_parallel", 1, ["--strategy", "model_parallel",
                                "--parallel.device_map={'blocks.1' = 'cpu'}", *CPU],
          "model_parallel"),
    _case("horovod", 2, ["--strategy", "horovod", *CPU], "horovod", needs_horovod),
    # Composed layouts by their degrees alone: parallel.strategy stays auto.
    _case("ddp_x_tp", 4, ["--parallel.dp_replicate", "2", "--parallel.tp", "2", *CPU], "ddp"),
    _case("ddp_x_pp", 4, ["--parallel.dp_replicate", "2", "--parallel.pp", "2", *CPU],
          "pipeline"),
    _case("fsdp_x_tp_x_pp", 8, ["--parallel.dp_shard", "2", "--parallel.tp", "2",
                                "--parallel.pp", "2", *CPU], "pipeline"),
    _case("hsdp_x_tp", 8, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2",
                           "--parallel.tp", "2", *CPU], "fsdp", pytest.mark.slow),
]


def test_every_registered_preset_is_in_the_family():
    """A strategy registered later must be added above, or this fails."""
    assert set(strategy_names()) <= {case.id for case in PRESETS}


@pytest.mark.parametrize("name, ranks, flags, strategy", PRESETS)
def test_the_default_gpt_trains_under_every_preset_and_layout(run_cli, tmp_path, name, ranks,
                                                              flags, strategy):
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
