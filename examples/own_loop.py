"""A training loop written for plain PyTorch: the starting point of
``own_loop_fleet.py``, which moves this same loop onto ``gpufleet.Fleet``.

Everything is by hand, as a distributed tutorial teaches it: the process group, a
``DistributedSampler`` on several ranks (its epoch set every epoch; alone, the loader
shuffles by itself), ``DistributedDataParallel``,
gradient accumulation with ``no_sync`` on all but the last micro-batch, clipping by
norm, SGD with momentum and a per-epoch ``StepLR``. The model has dropout, so the random
state matters as well as the weights.

    python examples/own_loop.py                          # one process
    torchrun --nproc-per-node 2 examples/own_loop.py     # two ranks
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

FEATURES, SAMPLES, SEED = 12, 384, 0
ACCUMULATE, CLIP = 2, 1.0


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 48), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(48, 1))


def build_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.sin(x[:, :1]) + x[:, 1:2] * 0.5 + 0.05 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train(epochs: int = 3, batch_size: int = 16) -> tuple[nn.Module, list[float]]:
    """Train on this process's rank (or alone); returns the model and every optimizer
    step's loss (the mean of its micro-batches, on this rank)."""
    distributed = "RANK" in os.environ
    if distributed and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(SEED)
    model = build_model()
    data = build_data()
    # Several ranks: a DistributedSampler shards and shuffles; alone: the loader's own.
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                 seed=SEED) if distributed else None
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler,
                        shuffle=sampler is None)
    net = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = build_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    losses: list[torch.Tensor] = []
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        step_loss = torch.zeros(())
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % ACCUMULATE == 0
            quiet = net.no_sync() if distributed and not last else contextlib.nullcontext()
            with quiet:
                loss = F.mse_loss(net(x), y)
                (loss / ACCUMULATE).backward()
            step_loss += loss.detach() / ACCUMULATE
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(step_loss)
                step_loss = torch.zeros(())
        scheduler.step()
    return model, [float(v) for v in losses]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank")
    args = p.parse_args()
    _, losses = train(args.epochs, args.batch_size)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{len(losses)} steps, final loss {losses[-1]:.4f}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
