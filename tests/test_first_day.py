"""What users of other trainers expect on day one (issue 19, part A): factories in the
current folder, run names, rerunnable configs, epochs, a preflight, clear rank errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

MYMOD = textwrap.dedent('''
    import torch
    from torch import nn

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

        def forward(self, x):
            return self.net(x)

    def classifier():
        return Classifier()

    def fakedata(n=64):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 8, generator=g)
        return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
''')
TOY = ["--model", "mymod:classifier", "--data", "mymod:fakedata",
       "--model.loss", "torch.nn.functional:cross_entropy", "--batch-size", "8",
       "--log.every", "2", "--monitor.report", "false", "--log.progress", "lines"]


def _write_mymod(folder) -> None:
    (folder / "mymod.py").write_text(MYMOD)


def _gpufleet_script(folder, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`gpufleet ARGS` as the console script runs it: `python -P` leaves the current
    folder off sys.path, as the script does."""
    from conftest import _env

    return subprocess.run([sys.executable, "-P", "-m", "gpufleet", *args], cwd=folder,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def test_factories_in_the_current_folder_are_found(tmp_path):
    """The gpufleet script (like `python -P`) does not put the current folder on
    sys.path by itself; gpufleet searches it for factories anyway."""
    _write_mymod(tmp_path)
    proc = _gpufleet_script(tmp_path, "train", *TOY, "--max-steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "gpufleet run summary" in proc.stdout


def test_optimizer_defaults_fit_the_model():
    from torch import nn

    from gpufleet.config import OptimConfig
    from gpufleet.models import build_gpt
    from gpufleet.train.optim import fill_optimizer_defaults

    def chosen(cfg, model):
        filled = fill_optimizer_defaults(cfg, model)
        return filled.lr, filled.weight_decay, filled.beta2

    gpt = build_gpt(n_layer=1, n_head=2, n_embd=16, block_size=8)
    resnet_like = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    assert chosen(OptimConfig(), gpt) == (3e-3, 0.1, 0.95)  # the "gpt" preset
    # Any other model: the optimizer as torch builds it, with no weight decay added.
    assert chosen(OptimConfig(), resnet_like) == (1e-3, 0.0, 0.999)
    sgd = fill_optimizer_defaults(OptimConfig(name="sgd"), resnet_like)
    assert (sgd.lr, sgd.momentum, sgd.weight_decay) == (1e-3, 0.0, 0.0)
    assert chosen(OptimConfig(lr=0.02), resnet_like) == (0.02, 0.0, 0.999)  # yours stays


def test_a_negative_optimizer_setting_other_than_auto_is_refused():
    from gpufleet.config import load_config
    from gpufleet.errors import ConfigError

    with pytest.raises(ConfigError, match=r"optim.lr = -0.5 is negative.*-1 for the model"):
        load_config(overrides=["optim.lr=-0.5"])


def test_runs_are_named_after_the_factories_and_their_config_reruns(run_cli, tmp_path):
    _write_mymod(tmp_path)
    run_cli("train", *TOY, "--max-steps", "2")
    (first,) = (tmp_path / "runs").glob("classifier-fakedata-*")
    assert 'name = "classifier-fakedata"' in (first / "config.toml").read_text()
    # The run's own config.toml starts a new run in a new directory, the first untouched.
    before = sorted(p.name for p in (first / "checkpoints").iterdir())
    proc = run_cli("train", "--config", str(first / "config.toml"), "--max-steps", "3")
    assert "starting a new run with it" in proc.stderr
    runs = sorted((tmp_path / "runs").glob("classifier-fakedata-*"))
    assert len(runs) == 2
    (second,) = [r for r in runs if r != first]
    assert (second / "checkpoints" / "step-0000003.pt").exists()
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == before
    # Continuing the old run is still one flag away.
    run_cli("train", "--config", str(first / "config.toml"), "--resume", str(first),
            "--max-steps", "4")
    assert (first / "checkpoints" / "step-0000004.pt").exists()


@pytest.mark.slow  # torchrun: test_distributed.py keeps a run under it
def test_under_torchrun_the_run_folder_is_timestamped(run_cli, tmp_path):
    _write_mymod(tmp_path)
    run_cli("--standalone", "--nproc-per-node", "2", "-m", "gpufleet", "train", *TOY,
            "--max-steps", "2", module="torch.distributed.run")
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"classifier-fakedata-\d{8}-\d{6}", run_dir.name), run_dir.name
    assert "nproc" in (run_dir / "config.toml").read_text()


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                          torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_fit_names_the_run_after_the_module_or_the_script(tmp_path, monkeypatch):
    import gpufleet
    from gpufleet.config import Config
    from gpufleet.train.checkpoint.rundir import run_name

    monkeypatch.chdir(tmp_path)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    result = gpufleet.fit(MLP(), data, loss_fn=torch.nn.functional.mse_loss,
                          overrides={"run.max_steps": 2, "log.progress": "off",
                                     "monitor.report": False, "data.batch_size": 8})
    assert re.fullmatch(r"mlp-\d{8}-\d{6}", Path(result.run_dir).name), result.run_dir
    monkeypatch.setattr(sys, "argv", ["/home/me/train_toy.py"])
    assert run_name(Config(), torch.nn.Sequential(torch.nn.Linear(2, 2))) == "train_toy"
    assert run_name(Config(), MLP()) == "mlp"


def _train_rows(run_dir):
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r["kind"] == "train"]


EPOCHS = ("--max-epochs", "2", "--optim.warmup_steps", "2", "--optim.decay", "cosine",
          "--optim.min_lr_ratio", "0.1")


def test_max_epochs_ends_the_run_and_shapes_the_schedule(run_cli, tmp_path):
    _write_mymod(tmp_path)  # 64 samples, batch 8: 8 steps an epoch
    proc = run_cli("train", *TOY, *EPOCHS, "--run-dir", "runs/epochs")
    rows = _train_rows(tmp_path / "runs/epochs")
    assert rows[-1]["step"] == 16  # without --max-steps, the epochs decide
    assert rows[-1]["lr"] == pytest.approx(1e-4)  # the decay ended at step 16: 0.1 x 1e-3
    assert "epoch 1.00/2 | loss" in proc.stderr and "epoch 2.00/2 | loss" in proc.stderr
    assert "│ epochs        │ 2.00" in proc.stdout
    # Whichever comes first: 5 steps end the run before 2 epochs do.
    run_cli("train", *TOY, "--max-epochs", "2", "--max-steps", "5", "--run-dir", "runs/s")
    assert _train_rows(tmp_path / "runs/s")[-1]["step"] == 5


@pytest.mark.slow  # exact resume mid-epoch: test_fault.py keeps a resume in the default run
def test_a_resume_mid_epoch_ends_where_the_uninterrupted_run_did(run_cli, tmp_path):
    _write_mymod(tmp_path)
    run_cli("train", *TOY, *EPOCHS, "--run-dir", "runs/epochs", "--checkpoint.every", "4",
            "--checkpoint.keep_last", "9")
    # Resuming mid-epoch (step 4 of 8) ends exactly where the uninterrupted run did.
    part = tmp_path / "runs/part/checkpoints"
    part.mkdir(parents=True)
    for f in (tmp_path / "runs/epochs/checkpoints").glob("step-0000004*"):
        shutil.copy(f, part / f.name)
    run_cli("train", *TOY, *EPOCHS, "--run-dir", "runs/part", "--resume", str(part))
    from conftest import final_params

    assert (part / "step-0000016.pt").exists()
    full, resumed = final_params(tmp_path / "runs/epochs"), final_params(part.parent)
    for key, value in full.items():
        assert torch.equal(resumed[key], value), key


def test_step_limit_defaults_to_600_unless_epochs_are_given():
    from gpufleet.config import load_config
    from gpufleet.errors import ConfigError
    from gpufleet.resolve import Machine, resolve

    cpu = Machine(cuda=False, gpus=0, bf16=False)

    def steps(**overrides):
        return resolve(load_config(overrides=overrides), cpu, world_size=1).run.max_steps

    assert steps() == 600
    assert steps(**{"run.max_epochs": 3}) == 0  # no step limit: the epochs end the run
    assert steps(**{"run.max_epochs": 3, "run.max_steps": 50}) == 50
    with pytest.raises(ConfigError, match=r"would never end.*--max-epochs N"):
        steps(**{"run.max_steps": 0})


def _train_without_loss(run_cli, tmp_path, *args: str) -> str:
    """`gpufleet train` of the toy classifier with --model.loss left out: exit 2, no
    traceback, one error line naming the fix; returns that line."""
    _write_mymod(tmp_path)
    no_loss = [a for a in TOY if a not in ("--model.loss", "torch.nn.functional:cross_entropy")]
    proc = run_cli("train", *no_loss, *args, expect=2)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr
    assert "--model.loss=package.module:function" in errors[0]
    assert "Traceback" not in proc.stderr
    return errors[0]


def test_a_config_mistake_is_one_line_before_any_rank_starts(run_cli, tmp_path):
    error = _train_without_loss(run_cli, tmp_path, "--nproc", "2")
    assert error.startswith("gpufleet: error: preflight: calling the model with the batch")
    assert "pass a loss function" in error and "\n" not in error.strip()
    assert not (tmp_path / "runs").exists()  # no run directory, no crash report


def test_a_config_mistake_in_one_process_is_one_line_without_a_crash_report(run_cli, tmp_path):
    """Without ranks to start there is no preflight: the first batch finds the mistake,
    and it reads as a config error (exit 2, the fix named), not as a crash."""
    error = _train_without_loss(run_cli, tmp_path, "--max-steps", "2")
    assert error.startswith("gpufleet: error: calling the model with the batch")
    [run_dir] = (tmp_path / "runs").iterdir()
    assert not (run_dir / "crash").exists()
    assert not list((run_dir / "procs").glob("*.json"))  # nothing left to clean up


def test_a_rank_failure_is_told_once_with_advice_that_fits(run_cli, tmp_path):
    _write_mymod(tmp_path)
    no_loss = [a for a in TOY if a not in ("--model.loss", "torch.nn.functional:cross_entropy")]
    proc = run_cli("train", *no_loss, "--nproc", "2", "--run.preflight=false", expect=1)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("First failure") == 1
    assert "This BatchError comes from the config or the code" in proc.stderr
    assert "raise --dist.max_restarts" not in proc.stderr


def test_failure_advice_follows_the_cause():
    from gpufleet.launch.failures import advice as _advice

    assert "dmesg" in _advice("", "", -9, "SIGKILL", 0)
    assert "batch_size" in _advice("OutOfMemoryError", "CUDA out of memory", 1, "", 0)
    assert "--dist.max_restarts N" in _advice("DistNetworkError", "Connection reset", 1, "", 0)
    assert "fix it and run again" in _advice("ConfigError", "bad", 1, "", 0)


FIT_SCRIPT = textwrap.dedent('''
    import json
    import torch
    import gpufleet
    from mymod import classifier, fakedata

    if __name__ == "__main__":
        result = gpufleet.fit(classifier(), fakedata(), loss_fn=torch.nn.functional.cross_entropy,
                              overrides={"dist.nproc": 2, "run.max_steps": 3,
                                         "log.progress": "lines", "monitor.report": False,
                                         "data.batch_size": 8})
        print(json.dumps({"steps": result.steps, "run_dir": result.run_dir}))
''')


def test_fit_starts_the_ranks_that_dist_nproc_asks_for(run_cli, tmp_path):
    _write_mymod(tmp_path)
    (tmp_path / "fit_two.py").write_text(FIT_SCRIPT)
    from conftest import _env

    proc = subprocess.run([sys.executable, "fit_two.py"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 3
    run_dir = tmp_path / result["run_dir"]
    assert run_dir.name.startswith("classifier-")
    config = (run_dir / "config.toml").read_text()
    assert 'strategy = "ddp"' in config and "nproc = 2" in config  # two ranks, not one
    assert "[rank 0]" in proc.stderr


def test_fit_refuses_clearly_what_it_cannot_send_to_the_ranks(tmp_path, monkeypatch):
    import gpufleet
    from gpufleet.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    with pytest.raises(ConfigError, match="loss function, which cannot be pickled"):
        gpufleet.fit(MLP(), data, loss_fn=lambda out, y: (out - y).pow(2).mean(),
                     overrides={"dist.nproc": 2, "log.progress": "off"})
    assert not (tmp_path / "runs").exists()


def test_a_transformers_model_gets_fine_tuning_defaults():
    transformers = pytest.importorskip("transformers")
    from gpufleet.config import OptimConfig
    from gpufleet.train.optim import fill_optimizer_defaults

    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        vocab_size=100))
    filled = fill_optimizer_defaults(OptimConfig(), bert)
    assert (filled.lr, filled.weight_decay, filled.beta2) == (5e-5, 0.0, 0.999)
