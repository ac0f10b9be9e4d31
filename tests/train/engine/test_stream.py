"""fit on a stream (an IterableDataset) in one process: TrainStream reads it through its
StreamShard (gpufleet.data.stream_shard), the checkpoint keeps its position, and a run
stopped and resumed (at another worker count) equals the uninterrupted one bit for bit;
epochs are passes of the stream, evaluation reads an eval stream, the data ledger's
audit checks it. The 2-rank stream is in tests/test_distributed.py
(test_ranks_started_by_fit_own_their_weights_and_equal_one_process)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from gpufleet.core.callbacks import Callback
from gpufleet.data.audit import audit
from gpufleet.errors import ConfigError


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step):
        if step == self.step:
            raise KeyboardInterrupt  # an interrupted run


def _fit(run_dir, overrides=None, callbacks=(), train=88):
    torch.manual_seed(0)  # the same weights every run
    model = toyjob.make_model(dropout=0.3)  # each step depends on the restored RNG
    base = {"run.dir": str(run_dir), "run.max_steps": 12, "checkpoint.every": 3,
            "data.batch_size": 16, "data.num_workers": 0, "run.eval_every": 4,
            "log.every": 1, "log.progress": "off", "optim.warmup_steps": 2}
    result = gpufleet.fit(model, toyjob.Stream(train), toyjob.Stream(40, start=200),
                          loss_fn=F.mse_loss, overrides={**base, **(overrides or {})},
                          callbacks=callbacks)
    return model, result


def test_a_stream_stopped_and_resumed_equals_the_uninterrupted_run(tmp_path):
    # 88 items: 5 batches of 16 a pass (8 left out, logged), so the passes end after
    # steps 5 and 10, and the step-6 checkpoint falls inside the second pass.
    straight, full = _fit(tmp_path / "a")
    assert full.epochs == 2.0  # two passes ended
    with pytest.raises(KeyboardInterrupt):
        _fit(tmp_path / "b", callbacks=[_StopAt(8)])
    # resumed from step 6 with 2 loader workers: the share reads on from its position
    resumed, rest = _fit(tmp_path / "b", {"checkpoint.resume": "latest",
                                          "data.num_workers": 2})
    assert [s for s, _ in rest.losses] == list(range(7, 13))
    assert rest.losses == full.losses[6:]
    assert rest.eval_losses == [e for e in full.eval_losses if e[0] > 6]
    for k, v in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=0)
    # The ledger: steps 7-8, read before the stop, are voided by the resume; each
    # finished pass read its 80 items once.
    report = audit(rest.run_dir)
    assert report.ok and "resume at step 6 (1 rank(s))" in report.events, report.lines()
    assert [(e.epoch, e.finished, e.once) for e in report.epochs] == \
        [(0, True, 80), (1, True, 80), (2, False, 32)], report.lines()
    assert any("stream" in note for note in report.notes)


def test_a_stream_takes_max_steps_not_max_epochs(tmp_path):
    with pytest.raises(ConfigError, match=r"run.max_epochs = 2.*stream.*run.max_steps"):
        _fit(tmp_path / "a", {"run.max_epochs": 2, "run.max_steps": -1})
    assert not (tmp_path / "a").exists()  # refused before the run began
