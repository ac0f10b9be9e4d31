"""A Fabric-style script: ``fleet.launch()`` with no function, outside a rank, runs
this script again as each of 2 ranks (run by tests/fleet/test_fleet_launch.py)."""

import json
import os
import sys
from pathlib import Path

import torch

import gpufleet

out = Path(sys.argv[1])
fleet = gpufleet.Fabric(accelerator="cpu", devices=2, run_dir=str(out / "run"))
fleet.launch()  # the parent waits for the ranks here, then exits
net = torch.nn.Linear(4, 1)
model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
fleet.backward(model(torch.ones(2, 4)).sum())
opt.step()
(out / f"rank{fleet.global_rank}.json").write_text(json.dumps(
    {"world": fleet.world_size, "args": sys.argv[2:], "step": fleet.step,
     "parent_pid": os.getppid()}))
fleet.finish()
