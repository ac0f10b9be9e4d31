"""An own loop where only rank 1 makes an all-reduce, at step 3 (a collective under
`if rank == 1`): gloo meets it with rank 0's gradient bucket and aborts rank 1. Run by
tests/fault/test_crash_forensics.py with `gpufleet run THIS --nproc 2 -- RUN_DIR`."""

import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import gpufleet

fleet = gpufleet.Fleet(accelerator="cpu", devices=2, run_dir=sys.argv[1])
torch.manual_seed(0)
net = torch.nn.Linear(64, 64)
model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
loader = fleet.setup_dataloaders(DataLoader(
    TensorDataset(torch.randn(256, 64), torch.randn(256, 64)), batch_size=8))
for step, (x, y) in enumerate(loader):
    fleet.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    if step == 2 and fleet.global_rank == 1:
        fleet.all_reduce(torch.ones(1))  # MISMATCH: rank 1 only
