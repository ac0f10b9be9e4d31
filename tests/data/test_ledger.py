"""The data ledger and its audit on real samplers: what each rank consumed, step by step,
through a restore, a kill and a world-size change; a tampered ledger fails naming the
indices."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from gpufleet.data.audit import audit
from gpufleet.data.bucket import BucketBatchSampler
from gpufleet.data.ledger import LEDGER_DIR, DataLedger, open_ledger
from gpufleet.data.sampler import ResumableDistributedSampler
from gpufleet.data.stream_shard import StreamShard
from gpufleet.errors import ConfigError
from gpufleet.train import ledger_cli


@dataclass
class Steps:
    step: int = 0


class Rank:
    """One rank reading as the training stream does: a segment, then batches."""

    def __init__(self, run_dir, sampler, steps, batch, restart=0):
        self.sampler, self.steps, self.batch = sampler, steps, batch
        self.ledger = open_ledger(run_dir, steps, sampler, restart)
        self.pos = 0

    def begin(self, epoch, event=True):
        seg = self.sampler.ledger_segment(epoch)
        seg["reads"] = seg["items"] // self.batch * self.batch
        self.ledger.begin(seg, 0, event=event, world=self.sampler.world_size,
                          rank=self.sampler.rank)

    def take(self):
        self.ledger.take(self.batch)


def _run(run_dir, world, steps_to, batch=4, n=32, start_step=0, state=None, close=True):
    """`world` ranks read from the sampler state `state` until step `steps_to`."""
    steps = Steps(start_step)
    ranks = []
    for r in range(world):
        s = ResumableDistributedSampler(n, rank=r, world_size=world, seed=3)
        if state is not None:
            s.load_state_dict(state)
        ranks.append(Rank(run_dir, s, steps, batch))
    for rank in ranks:
        rank.begin(ranks[0].sampler.epoch)
    taken = 0
    while steps.step < steps_to:
        for rank in ranks:
            rank.take()
        taken += batch
        steps.step += 1
    if close:
        for rank in ranks:
            rank.ledger.close()
    return ranks[0].sampler.state_dict(consumed=taken)


def test_an_epoch_read_by_two_ranks_passes(tmp_path):
    _run(tmp_path, 2, 4)  # 2 ranks x 4 steps x 4 samples: all 32
    report = audit(tmp_path)
    assert report.ok, report.lines()
    assert report.epochs[0].finished and report.epochs[0].once == 32


def test_a_resume_at_another_world_size_counts_only_the_committed_steps(tmp_path):
    at2 = _run(tmp_path, 2, 2)  # steps 1-2 at 2 ranks: 16 samples
    # A resume from step 1's position: step 2's samples are read again at 1 rank.
    step1 = {**at2, "samples": 8}
    _run(tmp_path, 1, 7, start_step=1, state=step1)  # steps 2-7: 24 samples
    report = audit(tmp_path)
    assert report.ok, report.lines()
    assert report.epochs[0].once == 32
    assert "resume at step 1 (1 rank(s))" in report.events


def test_a_killed_rank_leaves_its_steps_in_the_slot(tmp_path):
    _run(tmp_path, 2, 4, close=False)  # no close line: what the slot holds counts
    assert not any("close" in line for f in (tmp_path / LEDGER_DIR).glob("*.jsonl")
                   for line in f.read_text().splitlines())
    report = audit(tmp_path)
    assert report.ok and report.epochs[0].once == 32, report.lines()


def test_a_replay_without_its_restore_fails_naming_the_indices(tmp_path):
    _run(tmp_path, 2, 2)
    # Without its restore, the second run's step 2 looks like a second read.
    state = {"epoch": 0, "samples": 8, "seed": 3, "world_size": 2, "dataset_len": 32}
    _run(tmp_path, 2, 4, start_step=1, state=state)
    files = sorted((tmp_path / LEDGER_DIR).glob("*.jsonl"))
    assert audit(tmp_path).ok
    for path in files[2:]:  # the resumed run's ledgers lose their event lines
        lines = path.read_text().splitlines()
        path.write_text("\n".join(line for line in lines if '"event"' not in line) + "\n")
    report = audit(tmp_path)
    assert not report.ok
    problem = report.epochs[0].problems[0]
    order = ResumableDistributedSampler(32, seed=3).rank_indices(0)
    assert "consumed more than once" in problem
    assert f"sample(s) {order[8]}" in problem or str(order[8]) in problem.split("(")[0]
    assert "at step 2" in problem


def test_a_tampered_span_fails_naming_duplicated_and_missing_samples(tmp_path):
    _run(tmp_path, 2, 4)
    path = sorted((tmp_path / LEDGER_DIR).glob("*.jsonl"))[1]  # rank 1
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for rec in records:
        if "span" in rec:
            rec["pos0"] += 4  # rank 1 "did not read" its first batch
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    (path.with_suffix(".slot")).write_bytes(b"")
    report = audit(tmp_path)
    assert not report.ok
    order = ResumableDistributedSampler(32, rank=1, world_size=2, seed=3).rank_indices(0)
    problem = report.epochs[0].problems[0]
    assert "never consumed" in problem
    named = problem.split("sample(s) ")[1].split(" (")[0]
    assert sorted(map(int, named.split(", "))) == sorted(order[0:4])
    cli = subprocess.run([sys.executable, "-m", "gpufleet", "data", "audit", str(tmp_path)],
                         capture_output=True, text=True)
    assert cli.returncode == 1 and "never consumed" in cli.stdout, cli.stdout + cli.stderr


def test_two_epochs_and_the_loaders_drop_last(tmp_path):
    # 30 samples, 2 ranks of 15, batches of 4: each rank reads 12, 3 are left out.
    steps = Steps()
    ranks = [Rank(tmp_path, ResumableDistributedSampler(30, rank=r, world_size=2, seed=1),
                  steps, 4) for r in range(2)]
    for epoch in range(2):
        for rank in ranks:
            rank.begin(epoch, event=epoch == 0)
        for _ in range(3):
            for rank in ranks:
                rank.take()
            steps.step += 1
    report = audit(tmp_path)
    assert report.ok, report.lines()
    first = report.epochs[0]
    assert first.finished and first.once == 24 and len(first.dropped) == 6


def test_token_budget_batches_are_audited_by_sample(tmp_path):
    lengths = np.random.default_rng(0).integers(1, 9, size=40)
    steps = Steps()
    ranks = [Rank(tmp_path, BucketBatchSampler(lengths, token_budget=16, rank=r,
                                               world_size=2, seed=5), steps, 1)
             for r in range(2)]
    for rank in ranks:
        rank.begin(0)
    for _ in range(len(ranks[0].sampler)):
        for rank in ranks:
            rank.take()
        steps.step += 1
    report = audit(tmp_path)
    assert report.ok, report.lines()
    assert report.epochs[0].finished


def test_a_run_dir_without_a_ledger_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="holds no ledger"):
        ledger_cli.run(argparse.Namespace(run_dir=str(tmp_path)))


def test_a_span_changes_when_a_step_takes_another_amount(tmp_path):
    steps = Steps()
    s = ResumableDistributedSampler(40, seed=0)
    ledger = DataLedger(tmp_path / LEDGER_DIR, steps)
    ledger.begin({**s.ledger_segment(0), "reads": 40}, 0, event=True, world=1, rank=0)
    for amount in (4, 4, 4, 8, 4, 4):  # the fourth step takes twice as much
        for _ in range(amount // 4):
            ledger.take(4)
        steps.step += 1
    ledger.close()
    report = audit(tmp_path)
    assert report.ok and report.epochs[0].once == 28, report.lines()


def test_the_samples_a_restore_reads_again_are_those_of_the_steps_after_it(tmp_path):
    """What a receipt reports: the samples the steps after the restored one took, on
    every rank with a ledger here (a killed rank's from its slot), the lines written
    after the restore began left out."""
    import time

    from gpufleet.data.audit import replayed_since

    at = _run(tmp_path, 2, 5, n=64, close=False)  # 2 ranks x 5 steps x 4 samples; no close
    began = time.time()
    assert replayed_since(tmp_path, 3, began) == (2 * 2 * 4, 5)  # steps 4 and 5
    assert replayed_since(tmp_path, 5, began) == (0, 5)
    # The restore to step 3 goes on at one rank, to step 7; a second restore, to step 2,
    # reads again what steps 3 (first run) and 3-7 (second) took: steps 4-5 of the first
    # run already do not count.
    step3 = {**at, "samples": 3 * 8}
    time.sleep(0.01)
    _run(tmp_path, 1, 7, n=64, start_step=3, state=step3)
    samples, last = replayed_since(tmp_path, 2, time.time())
    assert last == 7 and samples == 2 * 4 + 4 * 4


def _stream_run(run_dir, shards, steps_per_pass=3, unit=4):
    """2 ranks reading a stream's shares (their segments claim ``shards``), a pass of
    ``steps_per_pass`` batches each, then a batch of the next pass."""
    steps = Steps()
    shares = [StreamShard(None, unit=unit, rank=r, world_size=2) for r in (0, 1)]
    ledgers = [open_ledger(run_dir, steps, share) for share in shares]
    for epoch, batches in ((0, steps_per_pass), (1, 1)):
        for ledger, share, shard in zip(ledgers, shares, shards, strict=True):
            seg = {**share.ledger_segment(epoch), "shard": shard, "reads": None}
            ledger.begin(seg, 0, event=epoch == 0, world=2, rank=share.rank)
        for _ in range(batches):
            for ledger in ledgers:
                ledger.take(unit)
            steps.step += 1
    for ledger in ledgers:
        ledger.close()


def test_a_stream_is_audited_by_its_chunks(tmp_path):
    """A stream's positions are its items: rank k of 2 reads items 4k..4k+3 of every row
    of 8. A pass read past is finished up to the furthest item read; a rank that read
    another's chunks is named with the items read twice and those never read."""
    _stream_run(tmp_path / "good", shards=(0, 1))
    report = audit(tmp_path / "good")
    assert report.ok, report.lines()
    assert [(e.epoch, e.finished, e.once) for e in report.epochs] == \
        [(0, True, 24), (1, False, 8)]
    assert any("stream" in note for note in report.notes)
    _stream_run(tmp_path / "bad", shards=(0, 0))  # rank 1 kept rank 0's chunks
    problems = audit(tmp_path / "bad").epochs[0].problems
    assert problems[0].startswith("consumed more than once: sample(s) 0, 1, 2, 3, 8, 9")
    assert "rank 0 of 2 at step 1" in problems[0]
    assert problems[1].startswith("never consumed: sample(s) 4, 5, 6, 7, 12")
