"""A Fleet loop that goes on in process after a lost node, as docs/own-loop.md writes it
(tests/cluster/test_fleet_recovery.py starts it with `gpufleet run` on each bed node).

One epoch of the toy regression over ``make_data_read_log`` (rank 1 kills its node at
its ``die_at``-th read), a snapshot after every step, the state registered: the model,
the optimizer, a StepLR schedule, the loader and a plain count of the samples the loop
trained on. ``Recovered`` is caught and the loop goes on. Rank 0 saves the initial and
the final state beside the run (``start.pt``, ``final.pt``) and writes what the loop saw
to ``seen.json``.

Usage: python fleet_loop.py RUN_DIR READS_DIR DIE_AT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import gpufleet
from toyjob import make_data_read_log, make_model


def main(run_dir: Path, reads: str, die_at: int) -> None:
    fleet = gpufleet.Fleet(accelerator="cpu", strategy="ddp", seed=0, run_dir=str(run_dir),
                           log_every=1, overrides={"fault.snapshot_every": 1,
                                                   "dist.timeout": 60})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    model, optimizer, scheduler = fleet.setup(model, optimizer, scheduler=scheduler)
    data = make_data_read_log(reads, delay=0.004, die_at=die_at)
    loader = fleet.setup_dataloaders(DataLoader(data, batch_size=16))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
             "loader": loader, "epoch": 0, "samples": 0}
    fleet.register_state(state)  # what the snapshots hold
    fleet.save(run_dir.parent / "start.pt", {"model": model})
    recovered = []  # not registered: kept across a recovery
    while state["epoch"] < 1:
        try:
            for x, y in loader:
                fleet.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                state["samples"] += len(x)
        except gpufleet.Recovered as back:  # the state is at back.step: go on from there
            recovered.append([back.step, back.world_size])
            continue
        state["epoch"] += 1
    fleet.save(run_dir.parent / "final.pt", state)
    if fleet.is_global_zero:
        (run_dir.parent / "seen.json").write_text(json.dumps(
            {"step": fleet.step, "world_size": fleet.world_size, "recovered": recovered}))
    fleet.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
