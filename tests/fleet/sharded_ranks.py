"""Run on each of 2 ranks by tests/fleet/test_sharded_save.py under ``gpufleet run
--nproc 2``.

``resume OUT`` (with ``--max-restarts 1``): on the first attempt the fsdp loop runs
uninterrupted (its final weights go to ``OUT/whole.pt``); a value of each rank's own
saved under ddp comes back to its rank; a zero1 loop saves, loads into fresh objects
and steps on (what each rank saw goes to ``OUT/round-rank<R>.pt``). Then the same
fsdp loop again, saving to ``OUT/crash-ck`` every 3 steps in the background, with a
batch read ahead (each rank's own) in its state; rank 1 SIGKILLs itself during step
7. The agent restarts both ranks, which load the checkpoint and finish; rank 0 writes
the final weights to ``OUT/crash.pt``.

``layouts OUT``: the same round trip as zero1's under tensor parallel (a GPT split over
both ranks) and hsdp, into ``OUT/layouts-rank<R>.pt``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpufleet
from gpufleet.models.gpt import GPT, GPTConfig

STEPS, SAVE_EVERY, KILL_AT = 10, 3, 7


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=g)  # 12 batches of 4 a rank: one epoch
    return TensorDataset(x, torch.sin(x[:, :1]) + 0.5 * x[:, 1:2])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (COLLECTIVE under fsdp and tp: an all-gather each)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.module.named_parameters()}


def fsdp_loop(out: Path, name: str, checkpoint: Path | None = None,
              kill: bool = False) -> dict[str, torch.Tensor]:
    """STEPS steps of AdamW under fsdp with dropout, reading one batch ahead; with
    ``checkpoint``: saved there every SAVE_EVERY steps (in the background), and
    resumed from it when it exists."""
    fleet = gpufleet.Fleet(accelerator="cpu", strategy="fsdp", seed=0,
                           run_dir=str(out / f"{name}-run"),
                           overrides={"checkpoint.async_save": checkpoint is not None})
    net = _net()
    model, opt = fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    loader = fleet.setup_dataloaders(DataLoader(_data(), batch_size=4, shuffle=True))
    batches = iter(loader)
    state = {"model": model, "optimizer": opt, "loader": loader, "step": 0,
             "ahead": next(batches)}  # this rank's next batch: its own
    if checkpoint is not None and checkpoint.exists():
        fleet.load(checkpoint, state)
        batches = iter(loader)  # on from the saved position (after "ahead")
        if fleet.global_rank == 0:
            (out / f"{name}-resumed.txt").write_text(str(state["step"]))
    while state["step"] < STEPS:
        x, y = state["ahead"]
        state["ahead"] = next(batches)
        fleet.backward(F.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        state["step"] += 1
        if checkpoint is not None and state["step"] % SAVE_EVERY == 0:
            fleet.save(checkpoint, state)
        if kill and state["step"] == KILL_AT and fleet.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no last words
    weights = _whole(model)
    fleet.finish()
    return weights


def per_rank_value(out: Path) -> dict:
    """ddp: a value each rank holds its own of, saved and loaded back."""
    fleet = gpufleet.Fleet(accelerator="cpu", strategy="ddp", run_dir=str(out / "ddp-run"))
    rank = fleet.global_rank
    state = {"mine": torch.tensor([10.0 + rank]), "shared": 3, "hidden": [rank, "x"]}
    fleet.save(out / "per-rank.pt", state)
    back = {"mine": None, "shared": None, "hidden": None}
    fleet.load(out / "per-rank.pt", back)
    everything = fleet.load(out / "per-rank.pt")
    fleet.finish()
    return {"back": back, "everything": everything}


def _train(fleet, model, opt, steps: int, batch) -> None:
    for _ in range(steps):
        fleet.backward(model(*batch) if isinstance(model.module, GPT) else
                       F.mse_loss(model(batch[0]), batch[1]))
        opt.step()
        opt.zero_grad()


def round_trip(out: Path, name: str, strategy: str, build, batch, **kw) -> dict:
    """2 steps, save, 2 more steps; a fresh Fleet loads and takes the same 2 steps:
    the weights must agree."""
    fleet = gpufleet.Fleet(accelerator="cpu", strategy=strategy,
                           run_dir=str(out / f"{name}-a"), **kw)
    net = build()
    model, opt = fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    _train(fleet, model, opt, 2, batch)
    fleet.save(out / f"{name}-ck", {"model": model, "optimizer": opt, "step": 2})
    _train(fleet, model, opt, 2, batch)
    first = _whole(model)
    kind = type(opt.optimizer).__name__
    fleet.finish()
    again = gpufleet.Fleet(accelerator="cpu", strategy=strategy,
                           run_dir=str(out / f"{name}-b"), **kw)
    torch.manual_seed(123)  # other initial weights: the load must replace them
    net = build()
    model, opt = again.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": opt, "step": 0}
    again.load(out / f"{name}-ck", state)
    _train(again, model, opt, 2, batch)
    second = _whole(model)
    again.finish()
    return {"first": first, "second": second, "step": state["step"], "optimizer": kind}


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))


def _mlp_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2 + rank)  # each rank its own batch
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def first_attempt(out: Path) -> None:
    whole = fsdp_loop(out, "whole")
    rank = int(os.environ["RANK"])
    if rank == 0:
        torch.save(whole, out / "whole.pt")
    seen = {"per_rank": per_rank_value(out),
            "zero1": round_trip(out, "zero1", "zero1", _net, _mlp_batch(rank))}
    torch.save(seen, out / f"round-rank{rank}.pt")


def resume(out: Path) -> None:
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first:
        first_attempt(out)
    final = fsdp_loop(out, "crash", out / "crash-ck", kill=first)
    if int(os.environ["RANK"]) == 0:
        torch.save(final, out / "crash.pt")


def layouts(out: Path) -> None:
    rank = int(os.environ["RANK"])
    # tensor parallel: both ranks are one replica, and read the same batch
    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(2))
    seen = {"tp": round_trip(out, "tp", "ddp", _gpt, (tokens[:, :-1], tokens[:, 1:]),
                             overrides={"parallel.tp": 2}),
            "hsdp": round_trip(out, "hsdp", "hsdp", _net, _mlp_batch(rank))}
    torch.save(seen, out / f"layouts-rank{rank}.pt")


if __name__ == "__main__":
    # One process group for the several Fleets in turn (none of them owns it, so none
    # leaves it at its finish and the next joins it as it is).
    dist.init_process_group("gloo")
    {"resume": resume, "layouts": layouts}[sys.argv[1]](Path(sys.argv[2]))
    dist.destroy_process_group()
