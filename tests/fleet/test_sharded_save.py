"""``Fleet.save`` / ``Fleet.load`` of sharded state (fsdp, hsdp, zero1, tensor parallel)
through fit's checkpointer, and values that differ between ranks.

On 2 gloo ranks (``gpufleet run``, tests/fleet/sharded_ranks.py): an fsdp loop saving
in the background is SIGKILLed and restarted and ends with the uninterrupted run's
weights bit for bit; a per-rank value comes back to its own rank; zero1 round trips
(tensor parallel and hsdp in the slow set). In this process: the 2-rank checkpoint
loads into one rank (fsdp and single), refuses its per-rank value naming the key, and
a damaged one is named; a checkpoint kept aside by a crash during its replacement is
found; a background save is waited for and its failure raised.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpufleet
from gpufleet.errors import CheckpointError
from gpufleet.fleet.perrank import digest
from gpufleet.train.checkpoint.files import MANIFEST, TRAINER_STATE
from gpufleet.train.checkpoint.sharded import previous_name, read_full_model

RANKS = Path(__file__).with_name("sharded_ranks.py")


def _gpufleet_run(*args: str, restarts: int = 0) -> None:
    cmd = [sys.executable, "-m", "gpufleet", "run", "--nproc", "2",
           "--max-restarts", str(restarts), str(RANKS), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Path:
    """2 ranks: the fsdp loop whole, a per-rank value, zero1; then the fsdp loop
    killed (rank 1, SIGKILL, step 7) and restarted by the agent."""
    out = tmp_path_factory.mktemp("sharded")
    _gpufleet_run("resume", str(out), restarts=1)
    return out


def test_a_killed_fsdp_loop_resumes_to_the_uninterrupted_weights(resumed):
    """Every 3 steps the loop saves (in the background) its sharded model and
    optimizer, its loader and the batch each rank read ahead; after the kill both
    ranks restart, load, and end bit for bit where the uninterrupted loop ended."""
    whole = torch.load(resumed / "whole.pt", weights_only=True)
    crash = torch.load(resumed / "crash.pt", weights_only=True)
    assert sorted(crash) == sorted(whole) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    for name, value in whole.items():
        assert torch.equal(crash[name], value), name
    # The restarted ranks loaded a checkpoint of before the kill (step 6's, or 3's when
    # step 6's was still being written in the background when rank 1 died).
    assert (resumed / "crash-resumed.txt").read_text() in ("3", "6")
    # The checkpoint is a directory of each rank's shards with a manifest of checksums.
    ck = resumed / "crash-ck"
    names = sorted(p.name for p in ck.iterdir())
    assert names == [".metadata", MANIFEST, "__0_0.distcp", "__1_0.distcp", TRAINER_STATE]
    state = torch.load(ck / TRAINER_STATE, weights_only=True)["_fleet"]
    assert state["shards"] == ["model", "optimizer"]
    assert state["state"]["step"] == 9 and "loader" in state["state"]
    first, second = state["per_rank"]["ahead"]  # each rank's own batch read ahead
    assert not torch.equal(first[0], second[0])


def test_a_value_that_differs_between_ranks_comes_back_to_its_own_rank(resumed):
    for rank in (0, 1):
        seen = torch.load(resumed / f"round-rank{rank}.pt", weights_only=True)["per_rank"]
        assert torch.equal(seen["back"]["mine"], torch.tensor([10.0 + rank]))
        assert seen["back"]["hidden"] == [rank, "x"] and seen["back"]["shared"] == 3
        assert torch.equal(seen["everything"]["mine"], torch.tensor([10.0 + rank]))
    saved = torch.load(resumed / "per-rank.pt", weights_only=True)
    assert saved["shared"] == 3 and "mine" not in saved  # not rank 0's, silently
    assert saved["_fleet"]["per_rank"]["hidden"] == [[0, "x"], [1, "x"]]


def test_zero1_saves_its_optimizer_state_whole_and_loads_it_back(resumed):
    """zero1: the optimizer state gathered on rank 0 into one file; a fresh loop with
    other initial weights loads it and takes the same two steps."""
    for rank in (0, 1):
        seen = torch.load(resumed / f"round-rank{rank}.pt", weights_only=True)["zero1"]
        assert seen["optimizer"] == "ZeroRedundancyOptimizer" and seen["step"] == 2
        for name, value in seen["first"].items():
            assert torch.equal(seen["second"][name], value), name
    saved = torch.load(resumed / "zero1-ck", weights_only=True)
    assert len(saved["optimizer"]["state"]) == 4  # every parameter's, from both ranks


def test_a_values_digest_is_its_content():
    """What the ranks compare: content, not order of a dict or set, nor object identity."""
    assert digest({"a": 1, "h": torch.zeros(2)}) == digest({"h": torch.zeros(2), "a": 1})
    assert digest({"b", "a"}) == digest({"a", "b"})
    assert digest(torch.tensor([1.0])) != digest(torch.tensor([2.0]))
    assert digest(torch.zeros(2)) != digest(torch.zeros(2, dtype=torch.float64))
    assert digest(torch.zeros(4)) != digest(torch.zeros(2, 2))
    assert digest([1, 2]) != digest((1, 2)) and digest(3) != digest(3.0)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))


def _one_rank(tmp_path: Path, strategy: str, name: str, init: int = 5, **kwargs) -> tuple:
    fleet = gpufleet.Fleet(accelerator="cpu", strategy=strategy, devices=1,
                           run_dir=str(tmp_path / name), **kwargs)
    torch.manual_seed(init)
    net = _mlp()
    model, opt = fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    return fleet, model, opt


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("strategy", ["fsdp", "single"])
def test_a_two_rank_fsdp_checkpoint_loads_into_one_rank(resumed, tmp_path, strategy):
    """2 ranks' shards read into one rank (still fsdp, or no sharding at all); the value
    each rank kept its own of has no rank to go to: refused naming it, or (strict=False)
    left as it is with a warning."""
    ck = resumed / "crash-ck"
    fleet, model, opt = _one_rank(tmp_path, strategy, "one")
    state = {"model": model, "optimizer": opt, "step": 0, "ahead": "mine"}
    with pytest.raises(CheckpointError, match=r"'ahead' differed between the 2 ranks"):
        fleet.load(ck, state)
    fleet.load(ck, {"model": model, "optimizer": opt, "step": 0})
    expected = read_full_model(ck)
    for name, value in _weights(model).items():
        assert torch.equal(value, expected[name]), name
    fleet.load(ck, state, strict=False)
    assert state["ahead"] == "mine" and state["step"] == 9
    ahead = fleet.load(ck)["ahead"]  # without a state: every saved rank's value
    assert len(ahead) == 2 and not torch.equal(ahead[0][0], ahead[1][0])
    fleet.backward(F.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 1)))
    opt.step()  # the loaded optimizer state steps on
    fleet.finish()


def test_a_file_saved_without_sharding_loads_into_an_fsdp_loop(tmp_path):
    """A single-rank file (whole tensors, optimizer state keyed by index) into a sharded
    model and optimizer: the next step is the one the saving loop takes."""
    batch = torch.ones(2, 6), torch.zeros(2, 1)

    def step(fleet, model, opt) -> dict[str, torch.Tensor]:
        fleet.backward(F.mse_loss(model(batch[0]), batch[1]))
        opt.step()
        opt.zero_grad()
        return {k: v.clone() for k, v in _weights(model).items()}

    fleet, model, opt = _one_rank(tmp_path, "single", "plain")
    step(fleet, model, opt)
    fleet.save(tmp_path / "plain.pt", {"model": model, "optimizer": opt})
    expected = step(fleet, model, opt)
    fleet.finish()
    sharded, model, opt = _one_rank(tmp_path, "fsdp", "sharded", init=9)
    sharded.load(tmp_path / "plain.pt", {"model": model, "optimizer": opt})
    for name, value in step(sharded, model, opt).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-7, msg=name)
    sharded.finish()


def test_a_damaged_sharded_checkpoint_is_named(resumed, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(resumed / "crash-ck", damaged)
    shard = damaged / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    fleet, model, opt = _one_rank(tmp_path, "fsdp", "run")
    with pytest.raises(CheckpointError, match=r"is damaged: __1_0.distcp is not what was "
                                              r"written \(SHA-256 check\)"):
        fleet.load(damaged, {"model": model, "optimizer": opt})
    (damaged / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"has no readable MANIFEST\.sha256"):
        fleet.load(damaged, {"model": model})
    fleet.finish()


def test_a_checkpoint_replaced_at_its_path_survives_a_crash_in_between(tmp_path, caplog):
    """Saving to one path again: the new directory takes the name only when complete,
    the previous one set aside until then; found there if the process stopped in that
    moment."""
    fleet, model, opt = _one_rank(tmp_path, "fsdp", "run")
    path = tmp_path / "ck"
    fleet.save(path, {"model": model, "step": 1})
    before = {k: v.clone() for k, v in _weights(model).items()}
    fleet.backward(F.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 1)))
    opt.step()
    fleet.save(path, {"model": model, "step": 2})
    assert not previous_name(path).exists()  # set aside, then removed
    path.rename(previous_name(path))  # as if stopped between the two renames
    state = {"model": model, "step": 0}
    with caplog.at_level(logging.WARNING, logger="gpufleet"):
        fleet.load(path, state)
    assert state["step"] == 2 and "is missing; the checkpoint it replaced" in caplog.text
    assert any(not torch.equal(v, before[k]) for k, v in _weights(model).items())
    fleet.finish()


def test_a_background_save_is_waited_for_and_its_failure_raised(tmp_path):
    fleet, model, opt = _one_rank(tmp_path, "fsdp", "run",
                                  overrides={"checkpoint.async_save": True})
    path = tmp_path / "ck"
    fleet.save(path, {"model": model, "optimizer": opt, "step": 1})
    saved = {k: v.clone() for k, v in _weights(model).items()}
    fleet.backward(F.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 1)))
    opt.step()  # changes the live weights while the copy is written
    state = {"model": model, "optimizer": opt, "step": 0}
    fleet.load(path, state)  # waits for the write, then reads it
    assert state["step"] == 1
    for name, value in _weights(model).items():
        assert torch.equal(value, saved[name]), name
    (tmp_path / "blocker").write_text("a file where a folder must go")
    fleet.save(tmp_path / "blocker" / "ck", {"model": model})  # fails in the background
    with pytest.raises(OSError, match="could not be written in the background"):
        fleet.save(path, {"model": model})
    fleet.finish()
    assert fleet.run.result.checkpoint_errors


@pytest.mark.slow
def test_tensor_parallel_and_hsdp_round_trip_on_two_ranks(tmp_path):
    """A GPT split over both ranks (tp = 2, its q/k/v heads strided) and an hsdp MLP:
    saved as shards, loaded into fresh objects with other weights, the same two steps
    after."""
    _gpufleet_run("layouts", str(tmp_path))
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"layouts-rank{rank}.pt", weights_only=True)
        for layout in ("tp", "hsdp"):
            assert seen[layout]["step"] == 2, layout
            for name, value in seen[layout]["first"].items():
                assert torch.equal(seen[layout]["second"][name], value), (layout, name)
    assert (tmp_path / "tp-ck" / "__1_0.distcp").is_file()
