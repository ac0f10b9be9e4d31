"""A DDP-tutorial-style regression, written for plain PyTorch and ported to gpufleet.

The plain version is what a distributed tutorial teaches: a small MLP, a synthetic
regression set, a ``DistributedSampler``, ``DistributedDataParallel``, SGD with momentum
and a ``StepLR`` schedule, launched with ``torchrun``. The gpufleet version keeps the
model, the data, the optimizer and the scheduler exactly as they are and hands them to
``gpufleet.fit``; gpufleet takes over the sampler, the wrapper, the launch, checkpoints
(exact resume), monitoring and the diagnosis. Nothing is added to the recipe: no
clipping, no warm-up, no other schedule.

    python examples/ddp_regression.py                       # gpufleet, 1 process
    python examples/ddp_regression.py --nproc 2             # gpufleet starts 2 ranks
    torchrun --nproc-per-node 2 examples/ddp_regression.py --plain   # the original
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gpufleet

FEATURES, SAMPLES = 10, 512


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 1))


def build_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.randn(FEATURES, 1, generator=g) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def build_scheduler(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def train_plain(epochs: int, batch_size: int) -> nn.Module:
    """The tutorial's loop (one process, or each rank under torchrun): the scheduler
    steps once per epoch."""
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build_model()
    data = build_data()
    sampler = DistributedSampler(data, shuffle=False) if distributed else None
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
    net = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = build_optimizer(model.parameters())
    scheduler = build_scheduler(optimizer)
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(net(x), y).backward()
            optimizer.step()
        scheduler.step()
    if distributed:
        dist.destroy_process_group()
    return model


def train_gpufleet(epochs: int, batch_size: int, nproc: int = 1,
                   overrides: dict | None = None) -> tuple[nn.Module, gpufleet.FitResult]:
    """The same training through gpufleet: model, data, optimizer and scheduler as they
    were; the sampler, DDP and the launch are gpufleet's."""
    torch.manual_seed(0)
    model = build_model()
    result = gpufleet.fit(
        model, build_data(), loss_fn=F.mse_loss, optimizer=build_optimizer,
        scheduler=build_scheduler,
        overrides={"run.max_epochs": epochs, "data.batch_size": batch_size,
                   "data.shuffle": False, "sched.interval": "epoch", "dist.nproc": nproc,
                   "run.eval_every": 0, **(overrides or {})})
    return model, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", action="store_true", help="run the original PyTorch loop")
    p.add_argument("--nproc", type=int, default=1, help="gpufleet: ranks to start")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    args = p.parse_args()
    if args.plain:
        train_plain(args.epochs, args.batch_size)
    else:
        _, result = train_gpufleet(args.epochs, args.batch_size, args.nproc)
        print(f"final loss {result.final_loss:.4f}; run directory {result.run_dir}")


if __name__ == "__main__":
    main()
