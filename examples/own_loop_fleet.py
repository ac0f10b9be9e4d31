"""The loop of ``own_loop.py`` moved onto ``gpufleet.Fleet``: the same model, data,
optimizer, scheduler, accumulation and clipping, and the same losses.

What changed, line by line: a ``Fleet`` instead of the process group; ``fleet.setup``
instead of DDP; ``fleet.setup_dataloaders`` instead of the ``DistributedSampler`` (no
``set_epoch`` needed); ``fleet.backward(loss)`` instead of ``loss.backward()``;
``fleet.no_backward_sync`` instead of ``no_sync``; ``fleet.clip_gradients`` instead of
``clip_grad_norm_``. What came with it: phase times on every rank, the diagnosis and
report.html in the run directory, the hang watchdog, crash reports, a step with a
non-finite loss or gradient skipped on every rank, and ``fleet.save``/``fleet.load``
that resume at the exact sample.

    python examples/own_loop_fleet.py                              # one process
    gpufleet run examples/own_loop_fleet.py --nproc 2              # two ranks
    torchrun --nproc-per-node 2 examples/own_loop_fleet.py         # the same, torchrun
    gpufleet run examples/own_loop_fleet.py --nproc 2 --max-restarts 1 -- \\
        --checkpoint runs/own-loop.pt                              # survives a crash

SIGTERM (or SLURM's SIGUSR1) stops every rank after the same step with a checkpoint in
the run directory and exit status 75; the same command again goes on from it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from own_loop import ACCUMULATE, CLIP, SEED, build_data, build_model, build_optimizer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import gpufleet


def train(fleet: gpufleet.Fleet, epochs: int = 3, batch_size: int = 16,
          checkpoint: str | None = None, save_every: int = 4,
          after_step: Callable[[int], None] | None = None) -> tuple[nn.Module, list[float]]:
    """Train on each rank; with ``checkpoint``, save there every ``save_every`` steps
    and continue from it when it exists. Returns the model and the losses of the steps
    run here (after a resume: from there on)."""
    torch.manual_seed(SEED)
    model = build_model()
    model, optimizer = fleet.setup(model, build_optimizer(model.parameters()))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    loader = fleet.setup_dataloaders(DataLoader(build_data(), batch_size=batch_size,
                                                shuffle=True))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
             "loader": loader, "epoch": 0, "step": 0}
    fleet.register_state(state)  # what a preemption (SIGTERM, SLURM's USR1) saves
    # Your own checkpoint, else the one a preemption left (Fleet(resume="auto")).
    resume = checkpoint if checkpoint and Path(checkpoint).exists() else fleet.resume_from
    if resume is not None:
        fleet.load(resume, state)
        fleet.print(f"resumed at step {state['step']} (epoch {state['epoch']})")
    losses: list[torch.Tensor] = []
    step_loss = torch.zeros((), device=fleet.device)
    for epoch in range(state["epoch"], epochs):
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % ACCUMULATE == 0
            with fleet.no_backward_sync(model, enabled=not last):
                loss = F.mse_loss(model(x), y)
                fleet.backward(loss / ACCUMULATE)
            step_loss += loss.detach() / ACCUMULATE
            if last:
                fleet.clip_gradients(model, optimizer, max_norm=CLIP)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(step_loss)
                step_loss = torch.zeros((), device=fleet.device)
                state["step"] += 1
                if checkpoint and state["step"] % save_every == 0:
                    state["epoch"] = epoch  # the loader knows where in it
                    fleet.save(checkpoint, state)
                if after_step is not None:
                    after_step(state["step"])
        scheduler.step()
        state["epoch"] = epoch + 1
    return model, [float(v) for v in losses]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank")
    p.add_argument("--checkpoint", default=None, help="save and resume here")
    p.add_argument("--run-dir", default=None, help="where the run's files go")
    args = p.parse_args()
    # resume="auto": a run preempted (exit status 75) goes on from its checkpoint when
    # the same command runs again (the newest run of this name, or --run-dir's).
    fleet = gpufleet.Fleet(accelerator="cpu", seed=SEED, run_dir=args.run_dir, log_every=4,
                           resume="auto")
    _, losses = fleet.launch(train, args.epochs, args.batch_size, args.checkpoint)
    fleet.print(f"{len(losses)} steps run here, final loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
