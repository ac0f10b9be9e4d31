"""Faults in one process: damaged checkpoints, failed writes, non-finite steps, stalls,
crash reports and failing sinks. The multi-rank versions are in test_fault_distributed."""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from gpufleet.config import FaultConfig
from gpufleet.core.callbacks import Callback
from gpufleet.errors import CheckpointError, TrainingStopped
from gpufleet.fault.stall_report import stall_report
from gpufleet.fault.watchdog import Watchdog
from gpufleet.precision import FP16Mixed
from gpufleet.train.checkpoint import format as ckpt


def _fit(tmp_path, overrides: dict, data=None, callbacks=(), model=None):
    torch.manual_seed(0)
    model = model or toyjob.make_model()
    base = {"run.out_dir": str(tmp_path / "runs"), "run.max_steps": 8,
            "log.progress": "off", "log.every": 1, "data.batch_size": 32,
            "optim.warmup_steps": 2, "data.num_workers": 0}  # reads counted in-process
    result = gpufleet.fit(model, data or toyjob.make_data(), loss_fn=F.mse_loss,
                          overrides={**base, **overrides}, callbacks=callbacks)
    return model, result


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step):
        if step == self.step:
            raise KeyboardInterrupt  # like Ctrl-C: no crash report, the run just ends


# -- checksums ---------------------------------------------------------------------------
def test_every_checkpoint_has_a_sha256sum_compatible_checksum(tmp_path):
    _fit(tmp_path, {"checkpoint.every": 4, "run.dir": str(tmp_path / "r")})
    files = ckpt.list_checkpoints(tmp_path / "r")
    assert [p.name for p in files] == ["step-0000004.pt", "step-0000008.pt"]
    for p in files:
        digest, name = ckpt.checksum_path(p).read_text().split()
        assert name == p.name
        assert digest == hashlib.sha256(p.read_bytes()).hexdigest()
    check = subprocess.run(["sha256sum", "-c", "step-0000008.pt.sha256"],
                           cwd=files[0].parent, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_truncated_latest_checkpoint_is_detected_and_the_previous_one_used(tmp_path, caplog):
    run = str(tmp_path / "r")
    common = {"run.max_steps": 12, "checkpoint.every": 4}
    straight, _ = _fit(tmp_path / "s", common)
    with pytest.raises(KeyboardInterrupt):  # stopped after the step-8 checkpoint
        _fit(tmp_path, {**common, "run.dir": run}, callbacks=[_StopAt(9)])
    latest = Path(run) / "checkpoints" / "step-0000008.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # a cut copy
    with caplog.at_level(logging.INFO):
        resumed, result = _fit(tmp_path, {**common, "run.dir": run,
                                          "checkpoint.resume": "latest"})
    assert "step-0000008.pt' is damaged" in caplog.text
    assert "resumed from" in caplog.text and "step-0000004.pt at step 4" in caplog.text
    assert result.steps == 12
    # Steps 5-12 were redone from step 4: the same weights as a run never interrupted.
    for k, v in _params(straight).items():
        torch.testing.assert_close(_params(resumed)[k], v, rtol=0, atol=0)


def test_resume_auto_starts_fresh_then_continues_a_requeued_run(tmp_path, caplog):
    # The requeue recipe passes --resume auto on every start of the job: the first start
    # finds nothing and trains from scratch; the requeued one continues from the newest.
    common = {"run.max_steps": 8, "checkpoint.every": 4, "run.name": "job"}
    straight, _ = _fit(tmp_path / "s", common)
    with pytest.raises(CheckpointError, match="--resume auto"):
        _fit(tmp_path, {**common, "checkpoint.resume": "latest"})
    with pytest.raises(KeyboardInterrupt):  # preempted after the step-4 checkpoint
        _fit(tmp_path, {**common, "checkpoint.resume": "auto"}, callbacks=[_StopAt(5)])
    with caplog.at_level(logging.INFO):
        resumed, result = _fit(tmp_path, {**common, "checkpoint.resume": "auto"})
    assert "resumed from" in caplog.text and "step-0000004.pt at step 4" in caplog.text
    assert result.steps == 8
    assert len(list((tmp_path / "runs").glob("job-*"))) == 1  # continued, not a new run
    for k, v in _params(straight).items():
        torch.testing.assert_close(_params(resumed)[k], v, rtol=0, atol=0)


def test_a_damaged_checkpoint_named_explicitly_is_an_error(tmp_path):
    _fit(tmp_path, {"run.dir": str(tmp_path / "r")})
    path = ckpt.list_checkpoints(tmp_path / "r")[-1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is damaged: its SHA-256 does not match"):
        _fit(tmp_path, {"checkpoint.resume": str(path)})


def test_a_checkpoint_the_launcher_verified_is_not_hashed_again_unless_it_changed(
        tmp_path, monkeypatch):
    _fit(tmp_path, {"run.dir": str(tmp_path / "r")})
    path = ckpt.list_checkpoints(tmp_path / "r")[-1]
    hashed = []
    real = ckpt.verify_checkpoint
    monkeypatch.setattr(ckpt, "verify_checkpoint", lambda p: hashed.append(p) or real(p))
    monkeypatch.setenv(ckpt.VERIFIED_ENV, "")  # restored after the test
    ckpt.find_resume_checkpoint(str(path), tmp_path, "gpt")
    assert hashed == [path]  # nobody vouched for it: hashed
    ckpt.mark_verified(path)  # what the launcher does after its own check
    assert ckpt.find_resume_checkpoint(str(path), tmp_path, "gpt") == path
    assert hashed == [path]  # not again
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged afterwards: size equal, mtime not
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is damaged"):
        ckpt.find_resume_checkpoint(str(path), tmp_path, "gpt")
    assert hashed == [path, path]


# -- failed checkpoint writes ------------------------------------------------------------
class _FullDisk:
    """A file that takes ``room`` bytes, then fails like a full disk."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_failed_checkpoint_write_is_reported_and_training_goes_on(tmp_path, monkeypatch,
                                                                    caplog):
    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return _FullDisk(f, room=100) if "step-0000008" in str(path) else f

    monkeypatch.setattr(ckpt, "open", open_on_a_full_disk, raising=False)
    run = tmp_path / "r"
    with caplog.at_level(logging.INFO):
        _, result = _fit(tmp_path, {"checkpoint.every": 4, "run.max_steps": 10,
                                    "run.dir": str(run)})
    assert result.steps == 10  # training went on past the failed write
    assert len(result.checkpoint_errors) == 1
    assert "step-0000008.pt could not be written" in caplog.text
    assert "No space left on device" in caplog.text
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-0000004.pt", "step-0000004.pt.sha256", "step-0000010.pt",
                     "step-0000010.pt.sha256"]  # no half-written step 8, no temp file
    ckpt.verify_checkpoint(run / "checkpoints" / "step-0000004.pt")


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 2 MiB file system (needs root to mount; skipped without)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_file_system_loses_no_checkpoint(tiny_tmpfs, tmp_path, caplog):
    run = tiny_tmpfs / "run"

    class FillTheDisk(Callback):
        """After the first checkpoint, fill the file system to the last byte."""

        def on_checkpoint(self, trainer, step, path):
            if step == 4:
                with open(tiny_tmpfs / "filler", "wb", buffering=0) as f:
                    try:
                        while True:
                            f.write(b"\0" * 4096)
                    except OSError:
                        pass

    with caplog.at_level(logging.INFO):
        _, result = _fit(tmp_path, {"checkpoint.every": 4, "run.max_steps": 10,
                                    "run.dir": str(run)}, callbacks=[FillTheDisk()])
    assert result.steps == 10
    assert len(result.checkpoint_errors) == 2 and "No space left on device" in caplog.text
    assert result.checkpoint.endswith("step-0000004.pt")  # the last good one
    (tiny_tmpfs / "filler").unlink()
    with caplog.at_level(logging.INFO):
        _, resumed = _fit(tmp_path, {"run.max_steps": 12, "run.dir": str(run),
                                     "checkpoint.resume": "latest"})
    # Steps 8 and 10 found the disk full; the step-4 checkpoint is intact and loads.
    assert resumed.steps == 12 and "step-0000004.pt at step 4" in caplog.text


# -- non-finite steps ----------------------------------------------------------------------
def test_a_nan_batch_is_skipped_and_counted(tmp_path, caplog):
    data = toyjob.make_data_nan_on_rank(rank=0, after=3 * 32 + 1, nan=1)  # in step 4
    with caplog.at_level(logging.WARNING):
        model, result = _fit(tmp_path, {"run.max_steps": 8}, data=data)
    assert result.steps == 8 and result.skipped_steps == 1
    assert all(torch.isfinite(v).all() for v in _params(model).values())
    assert "step 4 skipped on every rank: non-finite loss on rank 0" in caplog.text
    lines = [m for m in _metrics(result.run_dir) if m["kind"] == "train"]
    assert [m.get("skipped_steps", 0) for m in lines] == [0, 0, 0, 1, 0, 0, 0, 0]
    assert lines[3]["loss"] != lines[3]["loss"]  # NaN: that interval had no finite step


def test_too_many_bad_steps_in_a_row_stop_the_run_naming_the_parameter(tmp_path):
    data = toyjob.make_data_nan_on_rank(rank=0, after=1, nan=10_000)
    with pytest.raises(TrainingStopped, match=r"3 optimizer steps in a row.*first: 0.weight"):
        _fit(tmp_path, {"fault.max_skips_in_row": 3}, data=data)


def test_without_skipping_a_nan_reaches_the_weights(tmp_path):
    data = toyjob.make_data_nan_on_rank(rank=0, after=3 * 32 + 1, nan=1)
    model, result = _fit(tmp_path, {"fault.skip_nonfinite": False}, data=data)
    assert result.skipped_steps == 0
    assert not all(torch.isfinite(v).all() for v in _params(model).values())


def test_fp16_skips_a_nan_step_and_backs_off_the_loss_scale(tmp_path, caplog):
    data = toyjob.make_data_nan_on_rank(rank=0, after=3 * 32 + 1, nan=1)
    with caplog.at_level(logging.WARNING):
        model, result = _fit(tmp_path, {"precision.mode": "fp16-mixed",
                                        "precision.init_scale": 1024.0}, data=data)
    assert result.steps == 8 and result.skipped_steps == 1
    assert "non-finite loss on rank 0" in caplog.text
    assert "fp16 loss scale now 512" in caplog.text
    assert all(torch.isfinite(v).all() for v in _params(model).values())


def test_fp16_backoff_halves_the_loss_scale():
    precision = FP16Mixed("cpu", init_scale=1024.0)
    precision.scaler.scale(torch.ones(()))  # the scale exists once a loss was scaled
    assert precision.backoff() == 512.0
    assert precision.scaler.get_scale() == 512.0


# -- stalls ------------------------------------------------------------------------------------
def test_a_stalled_step_dumps_the_stack_and_says_where(tmp_path, caplog):
    data = toyjob.make_data_stalling_rank(rank=0, after=5 * 32 + 1, sleep=2.5)
    with caplog.at_level(logging.WARNING):
        _, result = _fit(tmp_path, {"run.max_steps": 8, "fault.stall_min_s": 0.8,
                                    "fault.watchdog_poll_s": 0.1}, data=data)
    hangs = Path(result.run_dir) / "hangs" / "1"
    report = (hangs / "report.txt").read_text()
    assert report.startswith("rank 0: step 6, loading the next batch")
    stack = (hangs / "rank-0.txt").read_text()
    assert "time.sleep(self.sleep)" in stack and "in __getitem__" in stack
    assert "stalled step" in caplog.text


def test_stall_report_names_the_rank_that_is_behind():
    beats = [{"rank": 0, "step": 7, "phase": "log", "phase_since": 95.0},
             {"rank": 1, "step": 7, "phase": "log", "phase_since": 96.0},
             {"rank": 2, "step": 6, "phase": "forward", "phase_since": 90.0},
             None]
    text = stall_report(beats, 100.0)
    first = text.splitlines()[0]
    assert first.startswith("rank 2 is behind: step 7, the forward pass")
    assert "for 10.0 s; rank 0, 1 wait in the metrics all-reduce" in first
    assert "no heartbeat from rank 3" in text


def test_stall_report_when_every_rank_is_stuck_in_the_same_place():
    beats = [{"rank": r, "step": 3, "phase": "backward", "phase_since": 0.0} for r in (0, 1)]
    assert stall_report(beats, 5.0).startswith("every rank is at the same point: step 4")


def test_stall_report_tells_a_silent_rank_from_one_that_is_behind():
    beats = [{"rank": 0, "step": 9, "phase": "backward", "phase_since": 90.0, "age_s": 0.4},
             {"rank": 1, "step": 8, "phase": "optimizer", "phase_since": 80.0, "age_s": 30.0,
              "node": 1, "addr": "10.0.0.2", "host": "b", "pid": 7}]
    text = stall_report(beats, 100.0, silent_after=10.0)
    assert text.splitlines()[0] == (
        "rank 1 (node 1, 10.0.0.2, host b, pid 7) stopped answering: no heartbeat for 30 s "
        "(last seen with 8 steps done, phase 'optimizer'); its node is down or cut off, it "
        "is not slow")
    assert "still answering: rank 0" in text and "behind" not in text
    # Without the ages, the same beats read as a rank that is behind.
    assert stall_report(beats, 100.0).startswith("rank 1 is behind")


def test_a_silent_rank_is_named_by_its_process_state_when_its_node_answers():
    from gpufleet.fault.procstate import GONE, process_state

    me = process_state(os.getpid())
    assert me in ("R", "S")
    beat = {"rank": 1, "step": 8, "phase": "forward", "phase_since": 80.0, "age_s": 16.0,
            "node": 0, "host": "a", "pid": 7}
    words = {"T": "is alive but stopped (state T", "D": "stuck in the kernel (state D",
             GONE: "is dead (it no longer runs)",
             "S": "alive (state S) but its heartbeats do not arrive"}
    for state, expect in words.items():
        first = stall_report([{**beat, "rank": 0, "age_s": 0.1},
                              {**beat, "proc_state": state}], 100.0,
                             silent_after=15.0).splitlines()[0]
        assert expect in first and "down or cut off" not in first, first
        assert "its process (pid 7 on a)" in first


def test_a_quiet_ranks_process_state_is_read_on_its_own_node_and_relayed():
    """Rank 1 (on "node-b") goes silent; rank 2, also on "node-b", reads its process
    (a real stopped one) from /proc and answers rank 0 through the store."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from gpufleet.fault.liveness import Liveness

    frozen = subprocess.Popen(["sleep", "60"])
    os.kill(frozen.pid, signal.SIGSTOP)
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=5))
    verdicts: dict[int, object] = {}
    watches = []
    try:
        for rank in range(3):
            store = host if rank == 0 else TCPStore("127.0.0.1", host.port, is_master=False,
                                                    timeout=timedelta(seconds=2))
            beat = {"rank": rank, "step": 1, "phase": "data", "host": "node-b",
                    "pid": frozen.pid if rank == 1 else os.getpid()}
            w = Liveness(store, "q", rank, 3, lambda b=beat: b, 0.05, 1.0,
                         lambda v, r=rank: verdicts.setdefault(r, v))
            if rank == 2:
                w._host = "node-b"
            watches.append(w)
            w.start()
        time.sleep(0.3)
        watches[1]._stop.set()  # rank 1 goes silent
        deadline = time.monotonic() + 10
        while 0 not in verdicts and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(verdicts[0].silent) == [1]
        assert verdicts[0].beats[1]["proc_state"] == "T"
        assert watches[0].limit(1) == 1.0  # beats every 50 ms: the floor holds
    finally:
        for w in watches:
            w._stop.set()
        frozen.kill()
        frozen.wait()


def test_liveness_names_a_rank_that_stops_beating_and_the_rank_that_lost_the_store():
    from datetime import timedelta

    from torch.distributed import TCPStore

    from gpufleet.fault.liveness import Liveness

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=5))
    client = TCPStore("127.0.0.1", host.port, is_master=False,
                      timeout=timedelta(seconds=1))
    verdicts: dict[int, object] = {}

    def watch(rank, store):
        return Liveness(store, "t", rank, 2, lambda: {"rank": rank, "step": 1,
                                                     "phase": "data"},
                        0.05, 0.5, lambda v: verdicts.setdefault(rank, v))

    zero, one = watch(0, host), watch(1, client)
    zero.start()
    one.start()
    time.sleep(0.4)
    assert not verdicts  # both beat: nobody is lost
    one.stop()  # rank 1 finished its run: it says so and is not counted as lost
    time.sleep(1.0)
    assert not verdicts
    one = watch(1, client)
    one.start()
    time.sleep(0.3)
    one._stop.set()  # rank 1 goes silent without a word (as when its node dies)
    deadline = time.monotonic() + 5
    while 0 not in verdicts and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(verdicts[0].silent) == [1] and verdicts[0].cut_off_s == 0
    assert verdicts[0].beats[1]["age_s"] > 0.5

    lonely = watch(1, client)
    lonely.start()
    zero.stop()
    zero._threads[0].join(timeout=5)
    del zero, host  # the store goes away: rank 1 can no longer reach it
    gc.collect()
    deadline = time.monotonic() + 10
    while 1 not in verdicts and time.monotonic() < deadline:
        time.sleep(0.05)
    lonely.stop()
    assert verdicts[1].cut_off_s > 0.5 and not verdicts[1].silent


@pytest.mark.parametrize("own_connection", [True, False])
def test_a_blocking_store_call_of_the_training_thread_does_not_cut_the_rank_off(
        own_connection):
    """A survivor waits in the store for rank 0's decision after a lost node (its
    training thread in a blocking ``wait``). Its heartbeats go over the watchdog's own
    connection and keep flowing; over the shared one they would wait behind that call
    and the rank would judge itself cut off (the case shown with ``own_connection``
    False)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from gpufleet.fault.liveness import Liveness

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=5))
    job = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=5))
    dog = Watchdog(FaultConfig(), tempfile.mkdtemp(), rank=1, world_size=2, store=job)
    assert dog.store is not job and dog.liveness.store is dog.store  # its own connection
    verdicts: dict[int, object] = {}
    ranks = [Liveness(host, "w", 0, 2, lambda: {"rank": 0, "step": 1, "phase": "data"},
                      0.05, 0.6, lambda v: verdicts.setdefault(0, v)),
             Liveness(dog.store if own_connection else job, "w", 1, 2,
                      lambda: {"rank": 1, "step": 1, "phase": "data"}, 0.05, 0.6,
                      lambda v: verdicts.setdefault(1, v))]
    for r in ranks:
        r.start()
    try:
        time.sleep(0.3)
        with pytest.raises(RuntimeError):  # DistStoreError: nobody decides here
            job.wait(["decision"], timedelta(seconds=2))  # the training thread waits
        time.sleep(0.3)
        if own_connection:
            assert not verdicts  # nobody was lost, nobody cut off
        else:
            assert verdicts[1].cut_off_s > 0.6
    finally:
        for r in ranks:
            r._stop.set()


def test_liveness_reads_the_same_when_no_rank_hosts_the_store():
    """The store served apart from the ranks (as `gpufleet store` serves one): rank 0 is
    a client like the others and still names the rank that went silent."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from gpufleet.fault.liveness import Liveness

    served = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=5))  # held by the test, by no rank
    verdicts: dict[int, object] = {}
    ranks = [Liveness(TCPStore("127.0.0.1", served.port, is_master=False,
                               timeout=timedelta(seconds=2)), "c", rank, 2,
                      lambda r=rank: {"rank": r, "step": 1, "phase": "data"}, 0.05, 0.5,
                      lambda v, r=rank: verdicts.setdefault(r, v)) for rank in (0, 1)]
    try:
        for w in ranks:
            w.start()
        time.sleep(0.3)
        assert not verdicts
        ranks[1]._stop.set()  # rank 1 goes silent
        deadline = time.monotonic() + 5
        while 0 not in verdicts and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(verdicts[0].silent) == [1] and verdicts[0].cut_off_s == 0
    finally:
        for w in ranks:
            w._stop.set()


# -- crashes and failing sinks ----------------------------------------------------------------
class _Explodes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.calls = toyjob.make_model(), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("boom in forward")
        return self.inner(x)


def test_a_fatal_error_leaves_a_crash_report(tmp_path):
    with pytest.raises(RuntimeError, match="boom in forward"):
        _fit(tmp_path, {"run.dir": str(tmp_path / "r")}, model=_Explodes())
    report = (tmp_path / "r" / "crash" / "rank-0.txt").read_text()
    assert "step: 2 (steps done)" in report and "phase: forward" in report
    assert "RuntimeError: boom in forward" in report and "Traceback" in report


def test_a_failing_sink_does_not_stop_training(tmp_path, caplog):
    class BrokenLogger(Callback):
        essential = False

        def on_log(self, trainer, step, metrics):
            raise ConnectionError("remote logger is down")

    with caplog.at_level(logging.ERROR):
        _, result = _fit(tmp_path, {}, callbacks=[BrokenLogger()])
    assert result.steps == 8
    assert "BrokenLogger failed in on_log (1 time(s) so far): ConnectionError" in caplog.text
    # The result names it (once, with its first error), so the summary can.
    assert result.callback_errors == {
        "BrokenLogger": "on_log: ConnectionError: remote logger is down"}


def test_an_essential_callback_error_still_stops_training(tmp_path):
    class Strict(Callback):
        def on_log(self, trainer, step, metrics):
            raise ValueError("bad callback")

    with pytest.raises(ValueError, match="bad callback"):
        _fit(tmp_path, {}, callbacks=[Strict()])


class _KillsALoaderWorker(Callback):
    """A contained callback (like the Advisor) running when a DataLoader worker dies:
    at step 3 the worker is killed with SIGKILL while the callback runs on."""

    essential = False

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.waited_out = False
        self.born = time.time()  # the loader's workers start after this

    def on_step_end(self, trainer, step):
        self.steps.append(step)
        if step != 3:
            return
        # Only this fit's workers: a test process may hold other children (earlier
        # tests' processes on the same test worker).
        workers = [p for p in psutil.Process().children()
                   if p.create_time() >= self.born - 1 and p.is_running()]
        assert workers, "the loader has no worker processes"
        os.kill(max(workers, key=lambda p: p.create_time()).pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # torch's SIGCHLD handler raises in this loop
        while time.monotonic() < deadline:
            time.sleep(0.01)
        self.waited_out = True


def test_a_loader_worker_killed_while_a_callback_runs_stops_the_run_at_once(tmp_path):
    callback = _KillsALoaderWorker()
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal"):
        _fit(tmp_path, {"data.num_workers": 2, "run.max_steps": 50},
             callbacks=[callback])
    assert callback.steps[-1] == 3  # no step after the worker's death
    assert not callback.waited_out  # the error came in the callback's wait, at once
