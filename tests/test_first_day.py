"""What users of other trainers expect on day one (issue 19, part A): factories in the
current folder, run names, rerunnable configs, epochs, a preflight, clear rank errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
    assert chosen(OptimConfig(), gpt) == (3e-3, 0.1, 0.95)
    assert chosen(OptimConfig(), resnet_like) == (1e-3, 0.01, 0.999)  # torch's AdamW
    assert chosen(OptimConfig(name="sgd"), resnet_like)[:2] == (0.1, 1e-4)
    assert chosen(OptimConfig(lr=0.02), resnet_like) == (0.02, 0.01, 0.999)  # yours stays


def test_a_negative_optimizer_setting_other_than_auto_is_refused():
    from gpufleet.config import load_config
    from gpufleet.errors import ConfigError

    with pytest.raises(ConfigError, match=r"optim.lr = -0.5 is negative.*-1 for the model"):
        load_config(overrides=["optim.lr=-0.5"])
