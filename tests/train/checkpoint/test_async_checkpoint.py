"""checkpoint.async_save: the training thread copies the state to host memory, a thread
writes it (atomically, with its checksum); the files equal a synchronous run's."""

from __future__ import annotations

import errno
import logging
import threading

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from gpufleet.core.callbacks import Callback
from gpufleet.train.checkpoint import format as ckpt
from gpufleet.train.checkpoint.async_writer import BackgroundWriter, to_host


def _fit(tmp_path, overrides: dict, callbacks=()):
    torch.manual_seed(0)
    model = toyjob.make_model(dropout=0.3)  # every step depends on the RNG state
    base = {"run.out_dir": str(tmp_path / "runs"), "run.max_steps": 12,
            "log.progress": "off", "data.batch_size": 48, "data.num_workers": 0,
            "checkpoint.every": 4, "checkpoint.keep_last": 5}
    result = gpufleet.fit(model, toyjob.make_data(), loss_fn=F.mse_loss,
                          overrides={**base, **overrides}, callbacks=callbacks)
    return model, result


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_the_host_copy_shares_nothing_with_the_live_state():
    live = {"model": {"w": torch.ones(3)}, "opt": [torch.zeros(2), (torch.ones(1), 5)],
            "step": 7}
    copy = to_host(live)
    live["model"]["w"].add_(1)
    live["opt"][0].add_(1)
    live["opt"][1][0].add_(1)
    assert copy["model"]["w"].tolist() == [1, 1, 1]
    assert copy["opt"][0].tolist() == [0, 0]
    assert copy["opt"][1][0].tolist() == [1] and copy["opt"][1][1] == 5
    assert copy["step"] == 7


def test_a_second_write_waits_for_the_first_and_errors_come_back_once():
    writer, order = BackgroundWriter(), []
    release = threading.Event()

    def first() -> None:
        release.wait()
        order.append(1)

    writer.submit(1, first, blocking_s=0.0)
    submitted = threading.Thread(target=writer.submit,
                                 args=(2, lambda: order.append(2), 0.0))
    submitted.start()
    assert writer.busy and order == []  # the first still writes; the second waits
    release.set()
    submitted.join()
    assert writer.wait() is None
    assert order == [1, 2]
    assert [t.step for t in writer.times] == [1, 2]

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    writer.submit(3, full_disk, blocking_s=0.0)
    error = writer.wait()
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert writer.wait() is None


def test_background_checkpoints_equal_synchronous_ones_and_pass_their_checksum(
        tmp_path, caplog):
    _, sync = _fit(tmp_path / "sync", {"run.dir": str(tmp_path / "s")})
    with caplog.at_level(logging.INFO, logger="gpufleet.train.checkpoint"):
        _, bg = _fit(tmp_path / "bg", {"run.dir": str(tmp_path / "a"),
                                       "checkpoint.async_save": True})
    assert bg.losses == sync.losses  # training itself is unchanged
    files = ckpt.list_checkpoints(tmp_path / "a")
    assert [p.name for p in files] == ["step-0000004.pt", "step-0000008.pt",
                                       "step-0000012.pt"]
    assert bg.checkpoint == str(files[-1]) and not bg.checkpoint_errors
    for path in files:
        ckpt.verify_checkpoint(path)  # complete, and its SHA-256 matches
        mine, theirs = ckpt.load_checkpoint(path), ckpt.load_checkpoint(
            tmp_path / "s" / "checkpoints" / path.name)
        # The state of the step it was taken at, though training went on meanwhile.
        for k, v in theirs["model"].items():
            torch.testing.assert_close(mine["model"][k], v, rtol=0, atol=0)
        assert mine["optimizer"]["state"].keys() == theirs["optimizer"]["state"].keys()
        for k, v in theirs["optimizer"]["state"].items():
            torch.testing.assert_close(mine["optimizer"]["state"][k]["exp_avg"],
                                       v["exp_avg"], rtol=0, atol=0)
        assert mine["sampler"] == theirs["sampler"] and _same(mine["rng"], theirs["rng"])
    background = [r for r in caplog.records if "in the background" in r.getMessage()]
    assert [r.checkpoint_step for r in background] == [4, 8, 12]
    assert all(0 <= r.checkpoint_blocking_s <= r.checkpoint_total_s for r in background)


def test_a_failed_background_write_is_reported_and_the_previous_one_stays(
        tmp_path, monkeypatch):
    real_save = ckpt.save_checkpoint

    def full_disk_at_8(run_dir, step, state, keep_last, keep=()):
        if step == 8:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(run_dir, step, state, keep_last, keep)

    monkeypatch.setattr(ckpt, "save_checkpoint", full_disk_at_8)
    _, result = _fit(tmp_path, {"run.dir": str(tmp_path / "r"), "run.max_steps": 10,
                                "checkpoint.async_save": True,
                                "checkpoint.save_final": False})
    assert result.steps == 10  # training went on
    assert len(result.checkpoint_errors) == 1
    assert "step-0000008.pt could not be written in the background" in \
        result.checkpoint_errors[0]
    assert "No space left on device" in result.checkpoint_errors[0]
    files = ckpt.list_checkpoints(tmp_path / "r")
    assert [p.name for p in files] == ["step-0000004.pt"]
    assert result.checkpoint == str(files[0])  # the newest one complete on disk
    ckpt.verify_checkpoint(files[0])


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step):
        if step == self.step:
            raise KeyboardInterrupt  # the run ends right after a background save


def test_a_run_that_ends_mid_write_leaves_the_checkpoint_complete(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _fit(tmp_path, {"run.dir": str(tmp_path / "r"), "checkpoint.async_save": True,
                        "checkpoint.every": 1}, callbacks=[_StopAt(5)])
    files = ckpt.list_checkpoints(tmp_path / "r")
    assert files[-1].name == "step-0000004.pt"
    ckpt.verify_checkpoint(files[-1])
    assert not [p for p in files[-1].parent.iterdir() if ".tmp-" in p.name]
