"""Real multi-process runs on CPU (gloo, 2 ranks), started the way users start them:
`gpufleet train --nproc 2` (torch's elastic agent), `--launcher spawn`, and `torchrun`."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import final_params
from equivalence import assert_same_weights
from gpufleet.data.audit import audit
from gpufleet.fault.receipt import read_receipts

TOY = ["--model", "toyjob:make_model", "--data", "toyjob:make_data",
       "--model.loss", "torch.nn.functional:mse_loss", "--max-steps", "12",
       "--log.every", "1", "--optim.warmup_steps", "2", "--run.out_dir", "runs"]


def _train(run_cli, tmp_path, name, *args, module="gpufleet", prefix=(), out=None):
    proc = run_cli(*prefix, "train", *TOY, "--run-dir", f"runs/{name}", *args, module=module)
    if out is not None:
        out.append(proc)
    return tmp_path / "runs" / name


def _assert_same_params(a, b, atol: float | None = None):
    """Another layout (atol None): the normwise rule of tests/equivalence.py. The same
    layout (atol 0) or another precision (fp16): element-wise, as given."""
    pa, pb = final_params(a), final_params(b)
    if atol is None:
        assert_same_weights(pb, pa)
        return
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=1e-4, atol=atol)


def _audit_passes(run_dir):
    """The data ledger's audit (`gpufleet data audit`, here without its start-up)
    proves every sample of each finished epoch was read once; returns its report."""
    report = audit(run_dir)
    assert report.ok, report.lines()
    return "\n".join(report.lines())


def _losses(run_dir):
    return [(r["step"], r["loss"]) for r in map(json.loads, open(run_dir / "metrics.jsonl"))
            if r["kind"] == "train"]


def test_ddp_two_ranks_equals_single_on_the_global_batch(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", "--batch-size", "32")
    ddp = _train(run_cli, tmp_path, "ddp", "--nproc", "2", "--strategy", "ddp",
                 "--batch-size", "16")
    _assert_same_params(single, ddp)
    config = (ddp / "config.toml").read_text()
    assert 'strategy = "ddp"' in config and 'backend = "gloo"' in config


@pytest.mark.slow  # accumulation over ranks: test_fsdp.py keeps it in the default run
def test_ddp_with_accumulation_equals_single(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", "--batch-size", "32")
    acc = _train(run_cli, tmp_path, "acc", "--nproc", "2", "--batch-size", "4",
                 "--grad-accum", "4")
    _assert_same_params(single, acc)


@pytest.mark.slow  # the spawn launcher: test_launcher.py keeps it in the default run
def test_spawn_launcher_matches_elastic(run_cli, tmp_path):
    elastic = _train(run_cli, tmp_path, "elastic", "--nproc", "2", "--batch-size", "16")
    spawn = _train(run_cli, tmp_path, "spawn", "--nproc", "2", "--batch-size", "16",
                   "--launcher", "spawn")
    _assert_same_params(elastic, spawn, atol=0)


def test_runs_unchanged_under_torchrun(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", "--batch-size", "32")
    under_torchrun = _train(run_cli, tmp_path, "torchrun", "--batch-size", "16",
                            module="torch.distributed.run",
                            prefix=("--standalone", "--nproc-per-node", "2", "-m", "gpufleet"))
    _assert_same_params(single, under_torchrun)


def test_killed_rank_is_restarted_and_the_run_finishes_as_if_nothing_happened(
        run_cli, tmp_path):
    clean = _train(run_cli, tmp_path, "clean", "--nproc", "2", "--batch-size", "16",
                   "--checkpoint.every", "2")
    # Rank 1 SIGKILLs itself after 100 samples (in step 7 of 12) on the first attempt;
    # the agent restarts both ranks, which resume from the step-6 checkpoint.
    procs: list = []
    killed = _train(run_cli, tmp_path, "killed", "--nproc", "2", "--batch-size", "16",
                    "--checkpoint.every", "2", "--data", "toyjob:make_data_killing_rank",
                    "--max-restarts", "1", out=procs)
    assert "resumed from" in procs[0].stderr and "at step 6" in procs[0].stderr
    assert [s for s, _ in _losses(killed)] == list(range(1, 13))
    _assert_same_params(clean, killed, atol=0)
    assert _losses(killed) == _losses(clean)
    # Rank 0 read into step 7 before the restart; the resume from step 6 voids that.
    assert "resume at step 6" in _audit_passes(killed)
    # The restart's receipt: the checkpoint read (its bytes and seconds), no step
    # repeated (rank 1 died reading step 7's batch: step 7 never finished), at most the
    # batch rank 0 took for step 7 read again, a re-warm over the steps after.
    [receipt] = read_receipts(killed)
    assert (receipt.kind, receipt.step, receipt.world_from, receipt.world_to) == \
        ("restart", 6, 2, 2)
    assert receipt.detected_by == "the elastic agent's restart 1"
    assert receipt.checkpoint["path"].endswith("step-0000006.pt")
    # (the step-6 file is gone by the end, kept files being few; the newest checkpoint
    # holds the same model and optimizer)
    newest = sorted((killed / "checkpoints").glob("step-*.pt"))[-1].stat().st_size
    assert abs(receipt.checkpoint["bytes"] - newest) < 0.05 * newest, (receipt, newest)
    assert 0 < receipt.checkpoint["seconds"] == receipt.phases["read"] <= receipt.total_s
    assert receipt.steps_repeated == 0 and receipt.samples_replayed in (0, 16), receipt
    assert receipt.rewarm_steps is not None and receipt.rewarm_steps >= 1
    assert receipt.line() in procs[0].stderr


@pytest.mark.slow  # multi-rank resume: the other-world-size resume keeps it in the default run
def test_resume_latest_continues_steps_and_loss_curve(run_cli, tmp_path):
    args = ["--optim.decay", "constant", "--batch-size", "16", "--name", "cont"]
    straight = _train(run_cli, tmp_path, "straight", *args)
    run_cli("train", *TOY, *args, "--max-steps", "5")
    run_cli("train", *TOY, *args, "--resume", "latest")
    (resumed,) = (tmp_path / "runs").glob("cont-*")
    assert [s for s, _ in _losses(resumed)] == list(range(1, 13))
    assert _losses(resumed) == _losses(straight)
    _assert_same_params(straight, resumed, atol=0)
    _audit_passes(resumed)


# Slow: the killed-rank test (bit-equal weights after a restart mid-run) and the
# world-size test below prove the data position in the default run.
@pytest.mark.slow
def test_resume_mid_epoch_reads_the_same_samples_on_every_rank(run_cli, tmp_path):
    """A 2-rank run killed mid-epoch (no restarts), then resumed with --resume latest,
    reads exactly the sample indices the uninterrupted run reads, rank by rank."""
    common = [*TOY, "--nproc", "2", "--batch-size", "16", "--checkpoint.every", "3",
              "--data.num_workers", "0", "--name", "rec"]
    # 128 samples per rank = 8 steps per epoch: step 6 is mid-epoch, 12 is in epoch 2.
    def data(out, **kill):
        extra = "".join(f", {k} = {v}" for k, v in kill.items())
        return ["--data", "toyjob:make_data_recording",
                f"--data.kwargs={{out = '{tmp_path / out}'{extra}}}"]
    run_cli("train", *common, *data("straight"), "--run-dir", "runs/straight")
    # Rank 1 dies while reading its batch of step 7; the step-6 checkpoint survives.
    failed = run_cli("train", *common, *data("first", kill_rank=1, kill_after=6 * 16),
                     "--run-dir", "runs/cut", expect=1)
    assert "rank 1" in failed.stderr.lower() or "rank: 1" in failed.stderr.lower()
    run_cli("train", *common, *data("resumed"), "--run-dir", "runs/cut", "--resume", "latest")
    for rank in (0, 1):
        straight = (tmp_path / "straight" / f"rank{rank}.txt").read_text().split()
        first = (tmp_path / "first" / f"rank{rank}.txt").read_text().split()
        resumed = (tmp_path / "resumed" / f"rank{rank}.txt").read_text().split()
        assert len(straight) == 12 * 16
        assert first[:6 * 16] + resumed == straight  # steps 1-6, then 7-12 after resume
    _audit_passes(tmp_path / "runs" / "cut")


def test_resume_at_other_world_sizes_reads_every_sample_of_the_epoch_once(run_cli, tmp_path):
    """2 ranks, killed; resumed at 1 rank, killed; resumed at 2 ranks to the end of the
    epoch. The samples of the committed steps (each checkpointed) cover the 256 samples
    of epoch 0 exactly once: the saved data position is global, not per rank."""
    common = [*TOY, "--batch-size", "16", "--checkpoint.every", "1", "--max-steps", "10",
              "--data.num_workers", "0", "--name", "ws", "--run-dir", "runs/ws"]

    def data(out, **kill):
        extra = "".join(f", {k} = {v}" for k, v in kill.items())
        return ["--data", "toyjob:make_data_recording",
                f"--data.kwargs={{out = '{tmp_path / out}'{extra}}}"]

    def committed(out, ranks, steps):  # what each rank read in its first `steps` steps
        return [i for r in range(ranks)
                for i in (tmp_path / out / f"rank{r}.txt").read_text().split()[:steps * 16]]

    # Steps 1-4 at 2 ranks (128 samples); rank 1 dies reading step 5.
    run_cli("train", *common, "--nproc", "2", *data("a", kill_rank=1, kill_after=64),
            expect=None)
    # Steps 5-8 at 1 rank (64 samples); it dies reading step 9.
    run_cli("train", *common, "--nproc", "1", "--resume", "latest",
            *data("b", kill_rank=0, kill_after=64), expect=None)
    # Steps 9-10 at 2 ranks: the last 64 samples of the epoch.
    done = run_cli("train", *common, "--nproc", "2", "--resume", "latest", *data("c"))
    assert "resumed from" in done.stderr and "at step 8" in done.stderr
    read = committed("a", 2, 4) + committed("b", 1, 4) + committed("c", 2, 2)
    assert sorted(map(int, read)) == list(range(256))
    # The ledger shows the same without the recording data set: 256 of 256 read once.
    report = _audit_passes(tmp_path / "runs" / "ws")
    assert "epoch 0 (finished): 256 of 256 samples consumed once" in report
    assert "resume at step 4 (1 rank(s))" in report and "resume at step 8" in report


@pytest.mark.slow  # a comm hook variant of ddp
def test_ddp_fp16_comm_hook_stays_close_and_bf16_on_gloo_names_the_fix(run_cli, tmp_path):
    """fp16 gradient compression stays close to plain ddp; bf16, which torch implements
    for NCCL only, is refused before any rank starts."""
    plain = _train(run_cli, tmp_path, "plain", "--nproc", "2", "--batch-size", "16")
    fp16 = _train(run_cli, tmp_path, "fp16", "--nproc", "2", "--batch-size", "16",
                  "--parallel.ddp.comm_hook", "fp16")
    _assert_same_params(plain, fp16, atol=2e-3)
    refused = run_cli("train", *TOY, "--nproc", "2", "--parallel.ddp.comm_hook", "bf16",
                      expect=2)
    assert "needs NCCL" in refused.stderr and "parallel.ddp.comm_hook=fp16" in refused.stderr


@pytest.mark.slow
def test_ddp_powersgd_comm_hook_trains(run_cli, tmp_path):
    psgd = _train(run_cli, tmp_path, "psgd", "--nproc", "2", "--batch-size", "16",
                  "--parallel.ddp.comm_hook", "powersgd", "--parallel.ddp.powersgd_start_step", "4")
    losses = [loss for _, loss in _losses(psgd)]
    assert losses[-1] < losses[0]


def test_ranks_started_by_fit_own_their_weights_and_equal_one_process(tmp_path):
    """gpufleet.fit sends the model to the ranks it starts; torch's multiprocessing sends
    tensors through shared memory, which would make every rank's SGD step land in every
    rank's weights (2 ranks: 2 updates a step). Plain SGD steps on 2 ranks x 16 must
    equal steps on the 32 samples by hand.

    The data is a stream (an IterableDataset of 80 items): rank k reads chunk k of each
    row of 2 x 16, so the steps take items 0-31 and 32-63; the last 16, short of a row,
    are left out and the pass ends; the third step reads items 0-31 of the next pass.
    The eval stream's 40 items are each counted once across the ranks (rank 0 reads 0-15
    and 32-39, rank 1 16-31); the ledger's audit finds every item of the pass read once."""
    import gpufleet
    import toyjob
    from gpufleet.train.checkpoint import format as ckpt

    torch.manual_seed(0)
    hand = toyjob.make_model()
    x, y = toyjob.make_data().tensors
    for rows in (slice(0, 32), slice(32, 64), slice(0, 32)):
        hand.zero_grad()
        torch.nn.functional.mse_loss(hand(x[rows]), y[rows]).backward()
        with torch.no_grad():
            for p in hand.parameters():
                p -= 0.2 * p.grad
    torch.manual_seed(0)
    result = gpufleet.fit(toyjob.make_model(), toyjob.Stream(80), toyjob.Stream(40, start=200),
                          loss_fn=torch.nn.functional.mse_loss,
                          optimizer=toyjob.plain_sgd,
                          overrides={"dist.nproc": 2, "data.batch_size": 16,
                                     "run.max_steps": 3,
                                     "data.num_workers": 0, "run.eval_every": 0,
                                     "log.progress": "off", "run.out_dir": str(tmp_path)})
    trained = ckpt.load_checkpoint(result.checkpoint)["model"]
    for name, value in hand.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert result.epochs == 1.0  # one pass of the stream ended
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(hand(x[200:240]), y[200:240]).item()
    assert result.eval_losses[-1][1] == pytest.approx(expected, rel=1e-5)
    report = audit(result.run_dir)
    assert report.ok and [(e.epoch, e.finished, e.once) for e in report.epochs] == \
        [(0, True, 64), (1, False, 32)], report.lines()
