"""What users of other trainers expect on day one (issue 19, part A): factories in the
current folder, run names, rerunnable configs, epochs, a preflight, clear rank errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
