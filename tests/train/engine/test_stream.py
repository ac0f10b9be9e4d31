"""fit on a stream (an IterableDataset) in one process: TrainStream reads it through its
StreamShard (gpufleet.data.stream_shard), the checkpoint keeps its position, and a run
stopped and resumed (at another worker count) equals the uninterrupted one bit for bit;
epochs are passes of the stream, evaluation reads an eval stream, the data ledger's
audit checks it, checkpoint.every_epochs saves after each pass, and `gpufleet
serve` loads the run. The 2-rank stream is in tests/test_distributed.py
(test_ranks_started_by_fit_own_their_weights_and_equal_one_process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from gpufleet.config import DataConfig
from gpufleet.core.callbacks import Callback
from gpufleet.data.audit import audit
from gpufleet.data.loaders import build_eval_loader
from gpufleet.errors import ConfigError
from gpufleet.serve.model import load_model
from gpufleet.train.engine.evaluator import Evaluator


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
            # recorded in config.toml: what `gpufleet serve RUN_DIR` builds again
            "model.name": "toyjob:make_model", "model.kwargs": {"dropout": 0.3},
            "data.name": "toyjob:Stream", "data.kwargs": {"n": 88},
            "checkpoint.every_epochs": 1, "checkpoint.keep_last": 9,
            "data.batch_size": 16, "data.num_workers": 0, "run.eval_every": 4,
            "log.every": 1, "log.progress": "off", "optim.warmup_steps": 2,
            "monitor.diagnose": False, "monitor.report": False}
    stream = toyjob.Stream(train) if isinstance(train, int) else train
    result = gpufleet.fit(model, stream, toyjob.Stream(40, start=200),
                          loss_fn=F.mse_loss, overrides={**base, **(overrides or {})},
                          callbacks=callbacks)
    return model, result


def test_a_stream_stopped_and_resumed_equals_the_uninterrupted_run(tmp_path):
    # 88 items: 5 batches of 16 a pass (8 left out, logged): steps 6 and 11 read past
    # the passes' ends, and the step-6 checkpoint falls inside the second pass.
    straight, full = _fit(tmp_path / "a")
    assert full.epochs == 2.0  # two passes ended
    # every 3 steps, and after the steps that read past a pass's end (6 and 11)
    saved = sorted(int(p.stem[5:]) for p in (tmp_path / "a" / "checkpoints").glob("step-*.pt"))
    assert saved == [3, 6, 9, 11, 12]
    # served from its run directory: the inputs' shape from the stream's first item
    served = load_model(str(tmp_path / "a"), device="cpu", trust_code=True)
    assert [(i.datatype, i.dims) for i in served.inputs] == [("FP32", (8,))]
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


def test_a_stream_that_splits_itself_is_refused_before_the_run_begins(tmp_path):
    datasets = pytest.importorskip("datasets")  # (an optional dependency: gpufleet[hf])
    stream = datasets.Dataset.from_dict({"x": [[0.0] * 8] * 40, "y": [[0.0]] * 40}) \
        .to_iterable_dataset(4)
    with pytest.raises(ConfigError, match="Hugging Face IterableDataset, read by 2"):
        _fit(tmp_path / "a", {"data.num_workers": 2}, train=stream)
    assert not (tmp_path / "a").exists()


def _evaluator(stream, rank, world, lockstep=False, most=0):
    """An evaluator of ``stream`` on rank ``rank`` of ``world``; in lockstep the other
    ranks' largest batch count is ``most`` (the all-reduce's answer, given here)."""
    loader = build_eval_loader(stream, DataConfig(batch_size=16, num_workers=0), rank=rank,
                               world_size=world, pin_memory=False)

    def all_reduce(tensor, op="sum"):
        tensor.fill_(max(most, tensor.item()))

    strategy = SimpleNamespace(eval_in_lockstep=lockstep, all_reduce=all_reduce)
    return Evaluator(loader, toyjob.make_model(), strategy, None, None, [],
                     device=torch.device("cpu"), pin_memory=False, channels_last=False,
                     max_batches=0, data_copies=1)


def test_an_eval_stream_is_shared_out_and_regrouped():
    """Each rank its chunks of every row (the last row as far as it goes); after the
    ranks regroup (the recovery calls reshard) the next evaluation reads the new share."""
    evaluator = _evaluator(toyjob.Stream(40), rank=1, world=2)
    assert [(len(b[0]), counted) for b, counted in evaluator._batches()] == [(16, True)]
    evaluator.reshard(0, 1)
    assert [len(b[0]) for b, _ in evaluator._batches()] == [16, 16, 8]


def test_an_eval_stream_in_lockstep_repeats_a_batch_uncounted():
    """Under a strategy whose forward is a collective, a rank with fewer batches of the
    stream repeats one, uncounted; with none of its own, the stream's first item."""
    short = _evaluator(toyjob.Stream(40), rank=1, world=2, lockstep=True, most=2)
    assert [(len(b[0]), c) for b, c in short._batches()] == [(16, True), (16, False)]
    empty = _evaluator(toyjob.Stream(10), rank=1, world=2, lockstep=True, most=1)
    (batch, counted), = list(empty._batches())
    assert not counted and torch.equal(batch[0], toyjob.make_data().tensors[0][:1])
