"""``import gpufleet.api`` brings the training stack: fit's first step imports none of it."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import _env

_SCRIPT = """
import json, sys, tempfile
import torch
import gpufleet.api
before = set(sys.modules)
late = []

class FirstStep(gpufleet.api.Callback):
    def on_step_end(self, view, step):
        if step == 1:
            late.extend(sorted(m for m in set(sys.modules) - before
                               if m.startswith("gpufleet")))

x, y = torch.randn(64, 8), torch.randn(64, 1)
with tempfile.TemporaryDirectory() as tmp:
    gpufleet.api.fit(torch.nn.Linear(8, 1), torch.utils.data.TensorDataset(x, y),
                     loss_fn=torch.nn.functional.mse_loss, callbacks=[FirstStep()],
                     overrides={"run.max_steps": 2, "log.progress": "off",
                                "data.batch_size": 16, "data.num_workers": 0,
                                "run.out_dir": tmp, "checkpoint.save_final": False})
print(json.dumps(late))
"""


def test_the_first_step_with_defaults_imports_no_module_of_gpufleet():
    # Lazily imported modules are compiled and run on the way to the first step, which
    # the user then waits for (tens of ms with this package's size); the import line is
    # where they belong.
    # A fresh user's process: none of the rank variables (RANK, MASTER_PORT...) an
    # earlier test of this worker may have left, which would make fit join a group.
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=120, env=_env())
    assert done.returncode == 0, done.stderr[-4000:]
    late = json.loads(done.stdout.strip().splitlines()[-1])
    assert late == [], late
