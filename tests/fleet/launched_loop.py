"""A loop whose Fleet starts its own 2 ranks (run by tests/fleet/test_fleet_launch.py)."""

import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import gpufleet


def train(fleet, tag, *, mark=""):  # tag and mark: sent to every rank
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = fleet.setup_dataloaders(DataLoader(data, batch_size=8))
    for x, y in loader:
        fleet.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    return tag + mark, fleet.global_rank, fleet.world_size, fleet.step, str(fleet.run_dir)


if __name__ == "__main__":
    fleet = gpufleet.Fleet(accelerator="cpu", devices=2, run_dir=sys.argv[1])
    print("result", fleet.launch(train, "sent", mark="!"))
