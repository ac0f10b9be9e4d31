"""Run on each of 2 ranks by tests/examples/test_own_loop.py (``gpufleet run``).

``twin OUT``: the plain PyTorch loop, then the same loop on Fleet (saving a checkpoint
every 4 steps), then a short Fleet loop whose rank 1 loss turns NaN at step 2, then the Fleet loop
with strategy fsdp, then Fabric's collectives (all_gather, broadcast, rank_zero_first,
log), then the own loops at scale of scale_loops.py (pipeline, model_parallel, a GAN
under fsdp, a stream); each rank writes what it saw to ``OUT/twin-rank<R>.pt``.
``crash OUT``: the Fleet loop again; on the first attempt rank 1 kills itself (SIGKILL)
during step 7, after the checkpoint of step 4; the elastic agent restarts both ranks,
which resume from it. Rank 0 writes the final weights to ``OUT/crash-final.pt``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import own_loop  # noqa: E402
import own_loop_fleet  # noqa: E402
import scale_loops  # noqa: E402  (beside this script)

import gpufleet  # noqa: E402

EPOCHS, BATCH = 2, 16


def _nonfinite_loop(out: Path) -> dict:
    """Three steps of SGD; rank 1's loss is NaN at step 2."""
    fleet = gpufleet.Fleet(accelerator="cpu", seed=0, run_dir=str(out / "nan-run"),
                           log_every=1)
    torch.manual_seed(0)
    model = own_loop.build_model()
    model, optimizer = fleet.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, own_loop.FEATURES), torch.randn(8, 1)
    seen = []
    for step in (1, 2, 3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == 2 and fleet.global_rank == 1:
            loss = loss * float("nan")
        fleet.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
    records = [vars(r) for r in fleet.skip_records]
    fleet.finish()
    return {"weights": seen, "skipped": fleet.skipped_steps, "records": records}


def _collectives(out: Path) -> dict:
    """Fabric's collectives as a loop calls them, on every rank."""
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(out / "comm-run"))
    rank = fleet.global_rank
    x = torch.tensor([float(rank + 1)], requires_grad=True)
    gathered = fleet.all_gather(x * 2, sync_grads=True)  # [[2.], [4.]] on every rank
    gathered.sum().backward()  # each rank's x gets both ranks' gradients: 2 + 2
    with fleet.rank_zero_first():  # rank 1 waits for rank 0's slow block
        if rank == 0:
            time.sleep(0.5)
        with open(out / "first.txt", "a") as f:
            f.write(f"{rank}\n")
    fleet.log("rank_seen", rank)  # rank 0's alone reaches the metrics file
    zero = gpufleet.Fleet(accelerator="cpu", strategy="zero1", run_dir=str(out / "z-run"))
    sharded = zero.setup_optimizers(torch.optim.SGD(
        zero.setup_module(own_loop.build_model()).parameters(), lr=0.1))
    zero.finish()
    seen = {"gathered": gathered.detach(), "x_grad": x.grad,
            "numbers": fleet.all_gather({"n": rank, "t": torch.arange(2) + 10 * rank}),
            "broadcast": fleet.broadcast({"from": rank}, src=1), "node": fleet.node_rank,
            "zero1": type(sharded.optimizer).__name__}
    fleet.finish()
    return seen


def _preempted(out: Path) -> dict:
    """The Fleet loop (checking for stop signals every step), where rank 1 alone gets
    SIGUSR1 after step 5: both ranks stop after step 6 with a checkpoint of the state
    the loop registered and raise SystemExit(75); a Fleet made again with
    resume="auto" (as the same command run again makes it) goes on from there."""
    def fleet() -> gpufleet.Fleet:
        return gpufleet.Fleet(accelerator="cpu", seed=own_loop.SEED, log_every=4,
                              run_dir=str(out / "preempt-run"), resume="auto",
                              overrides={"fault.preempt_check_every": 1})

    first = fleet()

    def usr1_to_rank_1(step: int) -> None:
        if step == 5 and first.global_rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # rank 0 learns of it from the flag

    code = None
    try:
        first.launch(own_loop_fleet.train, EPOCHS, BATCH, None, 4, usr1_to_rank_1)
    except SystemExit as stop:
        code = stop.code
    again = fleet()
    resumed_from = again.resume_from
    model, _ = again.launch(own_loop_fleet.train, EPOCHS, BATCH)
    return {"code": code, "stopped_at": first.step, "resumed_from": str(resumed_from),
            "checkpoint": first.run.result.checkpoint if first.run else None,
            "preempted": first.run.result.preempted if first.run else None,
            "steps": again.step, "weights": model.state_dict()}


def twin(out: Path) -> None:
    plain_model, plain = own_loop.train(EPOCHS, BATCH)  # joins the process group
    fleet = gpufleet.Fleet(accelerator="cpu", seed=own_loop.SEED,
                           run_dir=str(out / "twin-run"), log_every=4)
    model, ours = fleet.launch(own_loop_fleet.train, EPOCHS, BATCH,
                               str(out / "twin.pt"))
    nan = _nonfinite_loop(out)
    sharded = gpufleet.Fleet(accelerator="cpu", strategy="fsdp", seed=own_loop.SEED,
                             run_dir=str(out / "fsdp-run"), log_every=4)
    _, fsdp = sharded.launch(own_loop_fleet.train, EPOCHS, BATCH)
    comm = _collectives(out)
    preempted = _preempted(out)
    rank = int(os.environ["RANK"])
    scale = scale_loops.everything(out, rank)
    torch.save({"plain": plain, "fleet": ours, "plain_weights": plain_model.state_dict(),
                "fleet_weights": model.state_dict(), "nan": nan, "fsdp": fsdp,
                "comm": comm, "preempted": preempted, "scale": scale},
               out / f"twin-rank{rank}.pt")
    # The plain loop made the process group: leave it, as its script does. Left to the
    # interpreter's exit, torch's gloo group now and then aborts the process there.
    torch.distributed.destroy_process_group()


def crash(out: Path) -> None:
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    fleet = gpufleet.Fleet(accelerator="cpu", seed=own_loop.SEED,
                           run_dir=str(out / "crash-run"), log_every=4)

    def kill_rank_1(step: int) -> None:
        if step == 6 and first_attempt and fleet.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no last words

    model, _ = fleet.launch(own_loop_fleet.train, EPOCHS, BATCH, str(out / "crash.pt"),
                            4, kill_rank_1)
    if fleet.global_rank == 0:
        torch.save(model.state_dict(), out / "crash-final.pt")


def preempt(out: Path) -> None:
    """The Fleet loop, stopped by SIGTERM to the launcher on its first run: rank 0
    writes ``OUT/preempt-ready`` after step 3, and from there each step takes 0.3 s more,
    so that the signal lands mid-run. The same command again resumes (resume="auto")
    and rank 0 writes the final weights to ``OUT/preempt-final.pt``."""
    fleet = gpufleet.Fleet(accelerator="cpu", seed=own_loop.SEED, log_every=4,
                           run_dir=str(out / "term-run"), resume="auto",
                           overrides={"fault.preempt_check_every": 1})
    first = fleet.resume_from is None

    def slow_after_3(step: int) -> None:
        if first and step == 3 and fleet.global_rank == 0:
            (out / "preempt-ready").touch()
        if first and step >= 3:
            time.sleep(0.3)

    model, _ = fleet.launch(own_loop_fleet.train, EPOCHS, BATCH, None, 4, slow_after_3)
    if fleet.global_rank == 0:
        torch.save(model.state_dict(), out / "preempt-final.pt")


if __name__ == "__main__":
    {"twin": twin, "crash": crash, "preempt": preempt}[sys.argv[1]](Path(sys.argv[2]))
