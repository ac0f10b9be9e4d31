"""A training loop written for Lightning Fabric: the starting point of
``fabric_loop_fleet.py``, which moves this same loop onto ``gpufleet.Fleet``.

The loop uses what Fabric loops commonly do: the data set prepared once by rank 0
(``rank_zero_first``), the model set up first and the optimizer built on its parameters
afterwards (``setup_module``, ``setup_optimizers``: the FSDP recipe), gradient
accumulation without the gradient sync, clipping, an LR schedule per epoch, an
evaluation whose error is gathered from every rank (``all_gather``), logged values and
a checkpoint at the end. The model has dropout, so the random state matters as well as
the weights.

    torchrun --nproc-per-node 2 examples/fabric_loop.py --data /tmp/fabric-data.pt
    python examples/fabric_loop.py                   # one process

Its ``train`` is written against Fabric's calls only, so ``fabric_loop_fleet.py`` runs
this very function on a ``Fleet``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

if TYPE_CHECKING:
    from lightning.fabric import Fabric

FEATURES, SAMPLES, HELD_OUT, SEED = 10, 320, 64, 0
ACCUMULATE, CLIP = 2, 1.0


def prepare_data(path: Path) -> TensorDataset:
    """The data set, generated and written once (by the rank that comes first), then
    read from the file (by every rank)."""
    if not path.exists():
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES + HELD_OUT, FEATURES, generator=g)
        y = x[:, :1] * x[:, 1:2] + torch.cos(x[:, 2:3]) + 0.05 * torch.randn(
            len(x), 1, generator=g)
        torch.save({"x": x, "y": y}, path)
    saved = torch.load(path, weights_only=True)
    return TensorDataset(saved["x"], saved["y"])


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(32, 1))


def train(fabric: Fabric, data_path: Path, epochs: int = 2, batch_size: int = 16,
          checkpoint: Path | None = None) -> dict[str, list[float]]:
    """Train on each rank; returns this rank's step losses and the gathered evaluation
    error after each epoch."""
    with fabric.rank_zero_first():
        data = prepare_data(data_path)
    train_set = torch.utils.data.Subset(data, range(SAMPLES))
    held_out = torch.utils.data.Subset(data, range(SAMPLES, SAMPLES + HELD_OUT))
    model = fabric.setup_module(build_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3,
                                                          weight_decay=0.01))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader, eval_loader = fabric.setup_dataloaders(
        DataLoader(train_set, batch_size=batch_size, shuffle=True),
        DataLoader(held_out, batch_size=batch_size))
    seen: dict[str, list[float]] = {"losses": [], "eval_mse": []}
    for epoch in range(epochs):
        model.train()
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % ACCUMULATE == 0
            with fabric.no_backward_sync(model, enabled=not last):
                with fabric.autocast():
                    loss = F.mse_loss(model(x), y)
                fabric.backward(loss / ACCUMULATE)
            if last:
                fabric.clip_gradients(model, optimizer, max_norm=CLIP)
                optimizer.step()
                optimizer.zero_grad()
                seen["losses"].append(loss.item())
        scheduler.step()
        model.eval()
        error = torch.zeros(2, device=fabric.device)  # squared error, samples
        with torch.no_grad():
            for x, y in eval_loader:
                error += torch.stack([(model(x) - y).square().sum(),
                                      torch.tensor(float(len(y)), device=fabric.device)])
        every_rank = fabric.all_gather(error)  # one row per rank
        mse = float(every_rank[..., 0].sum() / every_rank[..., 1].sum())
        seen["eval_mse"].append(mse)
        fabric.log_dict({"eval_mse": mse, "epoch": epoch})
    if checkpoint is not None:
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
    fabric.barrier()
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="fabric-loop-data.pt", help="the data set's file")
    p.add_argument("--devices", type=int, default=None, help="ranks (default: torchrun's)")
    p.add_argument("--out", default=None, help="write each rank's results here")
    args = p.parse_args()
    from lightning.fabric import Fabric

    devices = args.devices or int(os.environ.get("WORLD_SIZE", "1"))
    fabric = Fabric(accelerator="cpu", devices=devices, precision="32-true")
    fabric.launch()
    fabric.seed_everything(SEED)
    seen = train(fabric, Path(args.data))
    if args.out:
        torch.save(seen, Path(args.out) / f"fabric-rank{fabric.global_rank}.pt")
    fabric.print(f"final loss {seen['losses'][-1]:.4f}, eval mse {seen['eval_mse'][-1]:.4f}")
    if torch.distributed.is_initialized():
        # Fabric leaves its process group to the interpreter's exit, where gloo's threads
        # can abort the process after the work is done ("terminate called without an
        # active exception"); PyTorch asks for this call before exiting.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
